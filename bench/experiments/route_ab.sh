#!/usr/bin/env bash
# Session 18 (2026-11-26): the peer benchmark's offline trace through the engine alone
# (docs/img/profile/offline_steps.py), the prefill chunks (512 rows) on the panel kernel
# (CHARIOT_CPU_SKINNY_MAX_ROWS=all) or on oneDNN's packed route (=64: panels up to 64 rows, as both
# runs have below), three pairs, alternating. summary.txt: route, pair, wall seconds, then the seconds
# of the step groups [1,16), [16,64), [64,256), [480,513) tokens; steps_<route>_<pair>.json: every step.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
out=docs/img/profile/route_ab
for i in 1 2 3; do
  for r in all 64; do
    CHARIOT_CPU_SKINNY_MAX_ROWS=$r .venv/bin/python docs/img/profile/offline_steps.py float32
    cp docs/img/profile/offline_steps_float32.json "$out/steps_${r}_$i.json"
    python3 -c "import json;d=json.load(open('$out/steps_${r}_$i.json'));print('$r',$i,round(d['wall_s'],1),[round(g['seconds'],1) for g in d['groups']])" >> "$out/summary.txt"
  done
done
git checkout docs/img/profile/offline_steps_float32.json
