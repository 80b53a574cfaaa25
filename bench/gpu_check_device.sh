#!/usr/bin/env bash
# `make gpu-check` on a lent device machine, as the one command its `run` tool is given.
#
# Why a script: that machine has no venv of ours (it would bring a CPU torch) and may have no make;
# its python3 has a CUDA torch and lacks a few of our packages, which `make gpu-wheels` downloads
# beforehand into build/gpu-wheels (carried with the call). A symlinked chariot/ tree on PYTHONPATH
# stands in for the install, as the Makefile's lint target does for mypy.
#
#     bash bench/gpu_check_device.sh [gpu_check arguments, e.g. --parts prepare,engine --budget-s 240]
#
# run: carry ["build/gpu-wheels"], timeout_s 540 (the check ends itself after its 450 s budget).
# Results go to build/gpu-check; where the machine sets OUT (the folder its tool brings back, at
# most 8 files), summary.json, report.md, the PNGs and an archive of the whole folder are copied there.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  build/gpu-wheels/*.whl || exit 3
mkdir -p /tmp/pkg/chariot
for d in cli contracts worker kernels router operator proto bench; do ln -sfn "$PWD/$d" "/tmp/pkg/chariot/$d"; done
export PYTHONPATH="/tmp/pkg:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -m chariot.bench.gpu_check --out build/gpu-check "$@"
rc=$?
if [ -n "${OUT:-}" ] && [ -d build/gpu-check ]; then
  cp build/gpu-check/summary.json build/gpu-check/report.md build/gpu-check/*.png "$OUT"/ 2>/dev/null
  tar czf "$OUT/gpu-check.tgz" -C build gpu-check
fi
exit $rc
