#!/usr/bin/env bash
# Was a change neutral for serving? The Chariot side of the peer benchmark (capacity search, offline
# round, one request's decode TBT through `chariot up`), run by two installs of Chariot alternately on
# one machine: BASE_VENV (e.g. a worktree of the commit before the change, installed editable into its
# own venv) and NEW_VENV, ROUNDS pairs, the order flipping every pair so drift hits both alike.
# OUT_DIR/<label>-<pair>/peer.json per run; OUT_DIR/summary.txt one line per run:
# label, pair, then the run's capacity, offline and single-request figures (JSON). Arguments after
# ROUNDS go to `chariot bench peer` (probe range, requests).
#   bench/experiments/serving_ab.sh /tmp/base-venv .venv models/100m docs/img/serving_ab 3 --requests 64
set -euo pipefail
base=$(realpath "${1:?usage: serving_ab.sh BASE_VENV NEW_VENV MODEL OUT_DIR [ROUNDS]}")
new=$(realpath "${2:?}")
model=$(realpath "${3:?}")
out=$(realpath -m "${4:?}")
rounds=${5:-3}
shift $(($# < 5 ? $# : 5))
mkdir -p "$out"
# Each run starts in a scratch folder whose build/vllm-venv/bin/python is /bin/false: builds that probe
# vLLM's version even for a Chariot-only run then record none instead of failing.
scratch=$(mktemp -d)
mkdir -p "$scratch/build/vllm-venv/bin"
ln -s /bin/false "$scratch/build/vllm-venv/bin/python"
for i in $(seq 1 "$rounds"); do
  order="base new"
  if [ $((i % 2)) -eq 0 ]; then order="new base"; fi
  for label in $order; do
    venv=$base
    if [ "$label" = new ]; then venv=$new; fi
    dir="$out/$label-$i"
    (cd "$scratch" && "$venv/bin/chariot" bench peer --model "$model" --systems chariot --variants fresh --quick \
      --out "$dir" "$@" > "$dir.log" 2>&1)
    python3 - "$dir/peer.json" "$label" "$i" >> "$out/summary.txt" <<'PY'
import json, sys
run = json.load(open(sys.argv[1]))["summary"][0]["systems"]["chariot"]
offline = {k: v for k, v in run["offline"].items() if not isinstance(v, list | dict)}
single = {k: v for k, v in run["single"].items() if not isinstance(v, list | dict)}
print(sys.argv[2], sys.argv[3], json.dumps({"capacity": run["capacity"], "offline": offline, "single": single}))
PY
  done
done
cat "$out/summary.txt"
