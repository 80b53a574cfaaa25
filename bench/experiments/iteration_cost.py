"""What an iteration costs each peer, split into a fixed part, prompt tokens and decodes, from both
servers' per-iteration logs of one `chariot bench peer` run.

Why: a full iteration's forward time (`full_iteration_timeline`) says whether the systems prefill at
the same rate, not where the rest of their time goes. Thousands of iterations of every mix, logged by
both servers over the same minutes, fit `forward ms = constant + a x prompt tokens + b x decodes`
(`server_iterations.fit_step_cost`): the constant is what every iteration pays (the weights read
once, the host's share), `a` the prompt token's linear layers and attention, `b` a decode's row of
the linear layers, its attention over its context, its sampling. Decode-only iterations, binned by
their batch, show the decode cost without the fit. Both logs cover the same probes and rounds,
interleaved, so the machine's moves fall on both; the fits are averages over them.

    .venv/bin/python -m chariot.bench.experiments.iteration_cost OUT_DIR VLLM_LOG[.gz] ITERATION_LOG[.gz]...

Writes OUT_DIR/iteration_cost.json (per system: the fit, and decode-only iterations per batch bin:
count, median ms and median share of the KV cache in use; Chariot over vLLM per coefficient and bin)
and iteration_cost.png.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from chariot.bench.server_iterations import StepCost, fit_step_cost, parse_chariot, parse_vllm, read_log_lines

DECODE_BINS = ((1, 1), (2, 3), (4, 7), (8, 15), (16, 31), (32, 63), (64, 127))
SYSTEMS = ("chariot", "vllm")


def load(vllm_log: Path, chariot_logs: Sequence[Path]) -> dict[str, list[dict[str, Any]]]:
    """Both systems' iteration records (`server_iterations`' record: prefill, decodes, forward_ms)."""
    return {"chariot": [r for path in chariot_logs for r in parse_chariot(read_log_lines(path))],
            "vllm": parse_vllm(read_log_lines(vllm_log))}


def decode_only(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per batch bin: iterations of decodes alone, their median forward ms and the median share of the
    KV cache in use in them (None where the log has none): two systems' bins compare as the same work
    only where their decodes attend over about as many cached tokens."""
    rows = []
    for lo, hi in DECODE_BINS:
        picked = [r for r in records if not r["prefill"] and lo <= r["decodes"] <= hi]
        ms = [r["forward_ms"] for r in picked]
        kv = [r["kv_usage"] for r in picked if r.get("kv_usage") is not None]
        rows.append({"decodes": [lo, hi], "iterations": len(ms), "median_ms": statistics.median(ms) if ms else None,
                     "median_kv_usage": statistics.median(kv) if kv else None})
    return rows


def report(records: Mapping[str, Sequence[Mapping[str, Any]]]) -> dict[str, Any]:
    fits = {s: fit_step_cost(records[s]) for s in SYSTEMS}
    bins = {s: decode_only(records[s]) for s in SYSTEMS}
    ratio = {k: _ratio(getattr(fits["chariot"], k), getattr(fits["vllm"], k))
             for k in ("constant_ms", "prompt_token_ms", "decode_ms")}
    bin_ratio = [_ratio(c["median_ms"], v["median_ms"]) if min(c["iterations"], v["iterations"]) >= 20 else None
                 for c, v in zip(bins["chariot"], bins["vllm"], strict=True)]
    return {"fit": {s: dataclasses.asdict(f) for s, f in fits.items()}, "decode_only": bins,
            "chariot_over_vllm": {"fit": ratio, "decode_only": bin_ratio}}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def plot(doc: Mapping[str, Any], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    colours = {"chariot": "tab:blue", "vllm": "tab:orange"}
    for system in SYSTEMS:
        pts = [((b["decodes"][0] * b["decodes"][1]) ** 0.5, b["median_ms"]) for b in doc["decode_only"][system]
               if b["median_ms"] is not None and b["iterations"] >= 20]
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", c=colours[system],
                label=f"{system}, decode-only iterations (median)")
        fit = StepCost(**doc["fit"][system])
        seen = [b["decodes"][1] for b in doc["decode_only"][system] if b["iterations"]]
        xs = [x for x in (1, 2, 4, 8, 16, 32, 64, 128) if x <= max(seen, default=1)]
        ax.plot(xs, [fit.predict_ms(0, x) for x in xs], linestyle="--", c=colours[system],
                label=f"{system} fit: {fit.constant_ms:.1f} + {fit.prompt_token_ms:.3f}/prompt token + "
                      f"{fit.decode_ms:.2f}/decode ms")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("decodes in the iteration")
    ax.set_ylabel("forward pass (ms)")
    ax.set_title("what an iteration costs, from both servers' per-iteration logs")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / "iteration_cost.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__)
        return 2
    out, vllm_log, chariot_logs = Path(argv[0]), Path(argv[1]), [Path(a) for a in argv[2:]]
    write_report(out, [vllm_log, *chariot_logs], load(vllm_log, chariot_logs))
    return 0


def write_report(out: Path, sources: Sequence[Path], records: Mapping[str, Sequence[Mapping[str, Any]]]) -> None:
    """Writes OUT/iteration_cost.json and the plot for records `load` read from `sources`, and prints
    the fits and the decode-only bins."""
    doc = {"sources": [p.name for p in sources], **report(records)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "iteration_cost.json").write_text(json.dumps(doc, indent=1) + "\n")
    for system in SYSTEMS:
        f = doc["fit"][system]
        print(f"{system:8} {f['constant_ms']:6.2f} ms + {f['prompt_token_ms']:.4f} ms/prompt token + "
              f"{f['decode_ms']:.3f} ms/decode (R² {f['r2']:.3f}, {f['iterations']} iterations)")
    print("chariot / vllm:", {k: round(v, 3) if v else v for k, v in doc["chariot_over_vllm"]["fit"].items()})
    for c, v, r in zip(doc["decode_only"]["chariot"], doc["decode_only"]["vllm"],
                       doc["chariot_over_vllm"]["decode_only"], strict=True):
        print(f"decodes {c['decodes'][0]}-{c['decodes'][1]}: chariot {c['iterations']} x {c['median_ms']} ms, "
              f"vllm {v['iterations']} x {v['median_ms']} ms, ratio {r and round(r, 3)}")
    print(plot(doc, out))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
