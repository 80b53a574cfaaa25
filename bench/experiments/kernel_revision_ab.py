"""The C++ attention kernel of this checkout against another revision's, on whole engine runs in one
process.

Why: a kernel change that wins per call (`chariot.bench.cpu_attention_bench --baseline-source`) has
to show on the engine, where attention is one part of a step. This runs the peer benchmark's offline
trace (64 chat requests ×0.25 at t=0, fresh prompts per round, `ignore_eos`) through one `LLM` on
the `100m` weights, the kernel build switched between rounds (order alternating, ROUNDS each after
a warm-up), and compares the greedy tokens of both builds on one batch. The other revision's
kernel sources (`kernels/csrc/*`) come out of git (`git show REV:...`) into a temporary directory
and build beside the current one (each build gets its own op namespace).

    .venv/bin/python -m chariot.bench.experiments.kernel_revision_ab REV [DTYPE] [OUT_DIR]   # ~7 min, bf16

From the repository root (git and `models/100m`). Writes OUT_DIR/kernel_revision_ab_<dtype>.json and
prints each build's median wall time.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from chariot.bench import offline_ab as ab
from chariot.bench.linear_bench import cpu_record
from chariot.kernels import cpu_attention
from chariot.worker import LLM

ROUNDS = 8
CSRC = "kernels/csrc"


def revision_source(rev: str, into: Path) -> Path:
    """The attention kernel's source at `rev`, with the headers beside it, written under `into`."""
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:{CSRC}"], check=True, capture_output=True,
                           text=True).stdout.split()
    for name in names:
        text = subprocess.run(["git", "show", f"{rev}:{CSRC}/{name}"], check=True, capture_output=True).stdout
        (into / name).write_bytes(text)
    return into / cpu_attention.SOURCE.name


def main(rev: str, dtype: str, out_dir: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        baseline = cpu_attention.load_kernel(revision_source(rev, Path(tmp)))
    builds = {"current": cpu_attention.load_kernel(), rev: baseline}
    llm = ab.load(dtype)
    current = cpu_attention.load_kernel

    def use(name: str) -> Callable[[], LLM]:
        def put() -> LLM:
            cpu_attention.load_kernel = lambda source=cpu_attention.SOURCE: builds[name]  # type: ignore[assignment]
            return llm
        return put

    walls, tokens = ab.run_variants({name: use(name) for name in builds}, ROUNDS, "kernel-ab")
    cpu_attention.load_kernel = current
    med, same = ab.medians(walls), ab.same_tokens(tokens, "current", rev)
    print(f"median wall: {rev} {med[rev]:.1f} s, current {med['current']:.1f} s ({med[rev] / med['current']:.2f}x); "
          f"greedy tokens identical in {same}/8 requests")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"kernel_revision_ab_{dtype}.json").write_text(json.dumps(
        {"machine": cpu_record(), "dtype": dtype, "baseline_revision": rev, "rounds": ROUNDS, "wall_s": walls,
         "median_s": med, "greedy_identical": same, "amx_tiles": cpu_attention.amx_tiles()}, indent=1))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: kernel_revision_ab REV [DTYPE] [OUT_DIR]")
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "bfloat16",
         Path(sys.argv[3]) if len(sys.argv) > 3 else Path("."))
