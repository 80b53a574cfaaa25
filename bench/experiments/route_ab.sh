#!/usr/bin/env bash
# The peer benchmark's offline trace through the engine alone (chariot.bench.experiments.offline_steps),
# the prefill chunks (512 rows) on the panel kernel (CHARIOT_CPU_SKINNY_MAX_ROWS=all) or on oneDNN's
# packed route (=64: panels up to 64 rows), three pairs, alternating. OUT_DIR/summary.txt: route, pair,
# wall seconds, then the seconds of the step groups [1,16), [16,64), [64,256), [480,513) tokens;
# OUT_DIR/steps_<route>_<pair>.json: every step. Run from anywhere:
#   bench/experiments/route_ab.sh docs/img/profile/route_ab
set -euo pipefail
out=$(realpath "${1:?usage: route_ab.sh OUT_DIR}")
mkdir -p "$out"
cd "$(dirname "$0")/../.."
for i in 1 2 3; do
  for r in all 64; do
    CHARIOT_CPU_SKINNY_MAX_ROWS=$r .venv/bin/python -m chariot.bench.experiments.offline_steps float32 "$out/steps_${r}_$i.json"
    python3 -c "import json;d=json.load(open('$out/steps_${r}_$i.json'));print('$r',$i,round(d['wall_s'],1),[round(g['seconds'],1) for g in d['groups']])" >> "$out/summary.txt"
  done
done
