"""One C++ kernel library of this checkout (the attention kernel's decode and vector op by default;
the layer kernels with `--library layer_ops`) against another revision's, on whole engine runs in one process.

Why: a kernel change that wins per call (`chariot.bench.cpu_attention_bench --baseline-source`) has
to show on the engine, where one op is one part of a step; and a change aimed at the engine (how
small steps use the thread pool) can only show there. This runs the peer benchmark's offline
trace (64 chat requests ×0.25 at t=0, fresh prompts per round, `ignore_eos`) through one `LLM` on
the `100m` weights, the kernel build switched between rounds (order alternating, ROUNDS each after
a warm-up), and compares the greedy tokens of both builds on one batch. The other revision's
kernel sources (`kernels/csrc/*`) come out of git (`git show REV:...`) into a temporary directory
and build beside the current one (each build gets its own op namespace).

    .venv/bin/python -m chariot.bench.experiments.kernel_revision_ab REV [DTYPE] [OUT_DIR] [--library NAME]
    # ~7 min, bf16; NAME: attention (default), layer_ops

From the repository root (git and `models/100m`). Writes OUT_DIR/kernel_revision_ab_<dtype>.json
(`kernel_revision_ab_<library>_<dtype>.json` for another library than attention) and prints each
build's median wall time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path
from types import ModuleType

from chariot.bench import offline_ab as ab
from chariot.bench.linear_bench import cpu_record
from chariot.kernels import cpu_attention, cpu_layer_ops

ROUNDS = 8
CSRC = "kernels/csrc"
# each module loads all of its ops through `load_kernel(source)`, which the rounds switch
LIBRARIES: dict[str, ModuleType] = {"attention": cpu_attention, "layer_ops": cpu_layer_ops}


def revision_source(rev: str, into: Path, library: ModuleType = cpu_attention) -> Path:
    """`library`'s source at `rev` (the attention kernel's unless given), with the headers beside it,
    written under `into`."""
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:{CSRC}"], check=True, capture_output=True,
                           text=True).stdout.split()
    for name in names:
        text = subprocess.run(["git", "show", f"{rev}:{CSRC}/{name}"], check=True, capture_output=True).stdout
        (into / name).write_bytes(text)
    return into / library.SOURCE.name


def main(rev: str, dtype: str, out_dir: Path, library: str = "attention") -> None:
    module = LIBRARIES[library]
    with tempfile.TemporaryDirectory() as tmp:
        baseline = module.load_kernel(revision_source(rev, Path(tmp), module))
    builds = {"current": module.load_kernel(), rev: baseline}
    llm = ab.load(dtype)
    current = module.load_kernel

    def use(name: str) -> None:
        setattr(module, "load_kernel", lambda source=module.SOURCE: builds[name])  # noqa: B010 (a module's function)

    walls, tokens = ab.run_variants(ab.switched(llm, use, builds), ROUNDS, "kernel-ab")
    setattr(module, "load_kernel", current)  # noqa: B010
    med, same = ab.medians(walls), ab.same_tokens(tokens, "current", rev)
    print(f"median wall: {rev} {med[rev]:.1f} s, current {med['current']:.1f} s ({med[rev] / med['current']:.2f}x); "
          f"greedy tokens identical in {same}/8 requests")
    out_dir.mkdir(parents=True, exist_ok=True)
    name = f"kernel_revision_ab_{dtype}.json" if library == "attention" else \
        f"kernel_revision_ab_{library}_{dtype}.json"
    (out_dir / name).write_text(json.dumps(
        {"machine": cpu_record(), "dtype": dtype, "library": library, "baseline_revision": rev, "rounds": ROUNDS,
         "wall_s": walls,
         "median_s": med, "greedy_identical": same, "amx_tiles": cpu_attention.amx_tiles()}, indent=1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="one kernel library against another revision's, on whole engines")
    parser.add_argument("rev")
    parser.add_argument("dtype", nargs="?", default="bfloat16")
    parser.add_argument("out_dir", nargs="?", type=Path, default=Path("."))
    parser.add_argument("--library", choices=sorted(LIBRARIES), default="attention")
    args = parser.parse_args()
    main(args.rev, args.dtype, args.out_dir, args.library)
