# One image for every Chariot component: `chariot worker`, `chariot router`, `chariot operator`,
# `chariot make-model` (the operator starts pods from it with those commands), in two flavours that
# differ only in the torch wheel, each a build target:
#
#   make image-cpu     # target cpu:  CPU torch (small)                -> <repo>:<version>-cpu
#   make image-cuda    # target cuda: CUDA torch (`make image`)        -> <repo>:<version>-cuda, <repo>:<version>
#
# `make` runs .ci/images.py, which picks a working builder (docker, podman or buildah), the base
# image, the CA bundle and where torch comes from (docs/images.md). A plain build works too:
#
#   docker build -t chariot:cpu .                                                    # the last target: cpu
#   docker build --target cuda --build-arg TORCH_INDEX_URL=https://pypi.org/simple -t chariot:cuda .
#
# On Linux x86-64, PyPI's own `torch` wheel *is* the CUDA build (its CUDA libraries come as
# nvidia-* wheels from PyPI too); download.pytorch.org/whl/cpu has the CPU-only one. The GPU driver
# (libcuda) comes from the node through the NVIDIA container runtime: the cuda target's torch is
# built for CUDA 13, which needs an NVIDIA driver >= 580 on the node (NVIDIA_REQUIRE_CUDA below makes
# the NVIDIA runtime refuse an older one with a message instead of a failing CUDA call later).
#
# Non-root (uid 10001, matching the pods' securityContext). The final image keeps a C/C++ compiler
# (gcc, g++) because things compile on first use, at worker start-up (the warm-up forward pass runs
# them before the worker reports ready, so a missing piece fails the pod, not a request): the CPU
# kernels (kernels/cpu_build.py, C++) where the image's baseline build does not fit the CPU (or a
# native build is asked for), and Triton's CUDA launcher
# stub (C, against the Python headers: python:3.11-slim has them in /usr/local/include, a Debian base
# gets them from python3-dev).
ARG BASE_IMAGE=python:3.11-slim

# The system both stages share: the base and a C/C++ compiler.
FROM ${BASE_IMAGE} AS system
RUN apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends gcc g++ libc6-dev \
    && rm -rf /var/lib/apt/lists/*

FROM system AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Non-empty: torch from the staged wheels (build/image-inputs/wheels), without an index.
ARG TORCH_FROM_WHEELS=
# Optional, for chariot's other dependencies: a mirror, or no index at all (every wheel staged);
# pip reads both from the environment.
ARG PIP_INDEX_URL
ARG PIP_NO_INDEX
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# What .ci/images.py stages in build/image-inputs, if anything: ca-certificates.crt (the CA bundle
# pip verifies TLS with, e.g. a proxy's) and wheels/. pyproject.toml is named only so that the COPY
# has a source when nothing was staged. Both stay in this stage: the final image has neither.
COPY pyproject.toml build/image-input[s] /tmp/inputs/
RUN python3 -m venv /opt/chariot
ENV PATH=/opt/chariot/bin:$PATH
# torch first, from the chosen index or the staged wheels: the default CPU wheels avoid gigabytes of
# CUDA libraries. (torch's own dependencies come with chariot's below.)
RUN if [ -s /tmp/inputs/ca-certificates.crt ]; then export PIP_CERT=/tmp/inputs/ca-certificates.crt; fi; \
    if [ -n "${TORCH_FROM_WHEELS}" ]; then \
        pip install --no-deps --no-index --find-links /tmp/inputs/wheels "torch==${TORCH_VERSION}"; \
    else \
        pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"; \
    fi
WORKDIR /src
COPY pyproject.toml README.md ./
COPY cli cli
COPY contracts contracts
COPY worker worker
COPY kernels kernels
COPY router router
COPY operator operator
COPY proto proto
COPY bench bench
RUN if [ -s /tmp/inputs/ca-certificates.crt ]; then export PIP_CERT=/tmp/inputs/ca-certificates.crt; fi; \
    links=; if [ -d /tmp/inputs/wheels ]; then links="--find-links /tmp/inputs/wheels"; fi; \
    pip install $links . && pip check
# The C++ CPU kernels' portable x86-64-v3 (AVX2) build, against this torch: pods load it and start
# without compiling on any AVX2 node (docs/kernels.md; elsewhere the command builds nothing and says so).
# Run from / : in /src the sources' operator/ would shadow the standard library's module.
WORKDIR /
RUN python -m chariot.kernels.cpu_build prebuild --baseline /opt/chariot/kernels-baseline

FROM system AS runtime
ARG IMAGE_VERSION=0.1.0
LABEL org.opencontainers.image.title="chariot" \
      org.opencontainers.image.description="Kubernetes-native LLM serving with the Sarathi-Serve scheduler" \
      org.opencontainers.image.version="${IMAGE_VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
# The user, written directly: a minimal Debian base has no useradd.
RUN echo 'chariot:x:10001:10001:Chariot:/tmp:/usr/sbin/nologin' >> /etc/passwd \
    && echo 'chariot:x:10001:' >> /etc/group
COPY --from=build /opt/chariot /opt/chariot
ENV PATH=/opt/chariot/bin:$PATH PYTHONUNBUFFERED=1 HOME=/tmp
USER 10001:10001
WORKDIR /tmp
EXPOSE 50061 9400 29500 8000 50051 8080
ENTRYPOINT ["chariot"]
CMD ["--help"]

# GPU nodes (and CPU nodes: a CUDA torch runs on CPU too); the Helm chart's default image.
FROM runtime AS cuda
ARG CUDA_MAJOR=13
RUN python -c "import sys, torch; v = torch.version.cuda or 'none'; \
sys.exit(0 if v.split('.')[0] == '${CUDA_MAJOR}' else \
'target cuda: torch is built for CUDA ' + v + ', not ${CUDA_MAJOR} (--build-arg TORCH_INDEX_URL=https://pypi.org/simple)')"
LABEL dev.chariot.flavour="cuda" \
      dev.chariot.nvidia-driver-min="580" \
      dev.chariot.cuda="${CUDA_MAJOR}"
ENV NVIDIA_REQUIRE_CUDA="cuda>=${CUDA_MAJOR}.0" NVIDIA_DRIVER_CAPABILITIES="compute,utility"

# CPU nodes only (the default target: the last one).
FROM runtime AS cpu
RUN python -c "import sys, torch; sys.exit(torch.version.cuda and \
'target cpu: this torch is a CUDA build; build the cuda target for it (--target cuda)')"
LABEL dev.chariot.flavour="cpu"
