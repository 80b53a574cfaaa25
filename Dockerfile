# One image for every Chariot component: `chariot worker`, `chariot router`, `chariot operator`,
# `chariot make-model` (the operator starts pods from it with those commands), in two flavours that
# differ only in the torch wheel:
#
#   docker build -t chariot:cpu .                                              # CPU torch (small)
#   docker build -t chariot:cuda --build-arg TORCH_INDEX_URL=https://pypi.org/simple .   # CUDA torch
#
# On Linux x86-64, PyPI's own `torch` wheel *is* the CUDA build (its CUDA libraries come as
# nvidia-* wheels from PyPI too); download.pytorch.org/whl/cpu has the CPU-only one. Nothing else
# changes: the GPU driver (libcuda) comes from the node through the NVIDIA container runtime.
#
# Non-root (uid 10001, matching the pods' securityContext). The final image keeps a C/C++ compiler
# (gcc, g++) because two things compile on first use, at worker start-up (the warm-up forward pass
# runs both before the worker reports ready, so a missing piece fails the pod, not a request): the
# CPU kernels (kernels/cpu_build.py, C++: paged attention, panel and skinny linear, layer ops) and Triton's CUDA launcher stub (C, against
# the Python headers that the python image ships in /usr/local/include).
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
ARG TORCH_VERSION=2.13.0  # what `make install` tests with
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/chariot
ENV PATH=/opt/chariot/bin:$PATH
# torch first, from the chosen index: the default CPU wheels avoid gigabytes of CUDA libraries.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
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
# The operator's own dependencies are named here too, so the image works whatever extras exist.
RUN pip install . "kopf>=1.37" "kubernetes>=30.1" "pyyaml>=6"

FROM python:${PYTHON_VERSION}-slim
LABEL org.opencontainers.image.title="chariot" \
      org.opencontainers.image.description="Kubernetes-native LLM serving with the Sarathi-Serve scheduler" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends gcc g++ libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN groupadd --gid 10001 chariot && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin chariot
COPY --from=build /opt/chariot /opt/chariot
ENV PATH=/opt/chariot/bin:$PATH PYTHONUNBUFFERED=1 HOME=/tmp
USER 10001:10001
WORKDIR /tmp
EXPOSE 50061 9400 29500 8000 50051 8080
ENTRYPOINT ["chariot"]
CMD ["--help"]
