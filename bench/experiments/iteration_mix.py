"""What both peers' iterations carried at each load of a `chariot bench peer` run, from the servers.

Why: where Chariot's capacity search fails on median TTFT, the prompt queue grew; this says whether
its iterations carried fewer tokens than vLLM's at the same load (more, smaller iterations for the
same work), or as many tokens more slowly. It reads the per-probe `iterations` records the harness
takes from both servers' own per-iteration logs (`bench/server_iterations.py`: Chariot's
`--iteration-log`, vLLM's `--enable-logging-iteration-details`) and writes one row per system and
load (and offline round): iterations, iterations per second of the probe's wall time, tokens per
iteration (mean, p10/p50/p90), the share of iterations carrying prompt tokens and the share that
filled the budget, prompt tokens per iteration that had some, decodes per iteration, the forward
pass's time (p50/p90 and the sum), and for Chariot the queue after each iteration.

    .venv/bin/python -m chariot.bench.experiments.iteration_mix PEER_JSON[.gz] [OUT_DIR]

Writes OUT_DIR/iteration_mix.json (default: beside PEER_JSON) and iteration_mix.png: tokens per
iteration against load for both systems over every search (left), and the distribution of tokens per
iteration at the lowest load where Chariot failed in the first search (right).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from chariot.bench.experiments.iterations_from_traces import load

SUMMARY_KEYS = ("iterations", "tokens", "tokens_mean", "tokens_p10", "tokens_p50", "tokens_p90", "share_with_prompt",
                "share_full", "prefill_tokens", "prefill", "decodes", "forward_ms", "forward_s", "full_forward_ms",
                "decode_only_forward_ms")
SERVER_ONLY_KEYS = ("waiting",)


def row(key: Mapping[str, Any], qps: float | None, verdict: str | None, wall_s: float | None,
        it: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """One system at one load; None when the probe has no iteration record (an older run)."""
    if not it or "error" in it or not it.get("iterations"):
        return None
    out = {**key, "qps": qps, "verdict": verdict, "source": it["source"],
           **{k: it.get(k) for k in SUMMARY_KEYS},
           "iterations_per_s": round(it["iterations"] / wall_s, 2) if wall_s else None}
    out.update({k: it[k] for k in SERVER_ONLY_KEYS if k in it})
    return out


def report(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Rows in run order: each run's probes by load, then its offline rounds (qps None)."""
    rows = []
    for run in doc["runs"]:
        key = {"variant": run["variant"], "search": run.get("search", 0), "system": run["system"]}
        for probe in run["probes"]:
            rows.append(row(key, probe["qps"], probe.get("verdict"), probe.get("summary", {}).get("wall_s"),
                            probe.get("iterations")))
        offline = run.get("offline", {})
        walls = [r.get("wall_s") for r in offline.get("rounds", [])]
        for i, it in enumerate(offline.get("round_iterations") or []):
            rows.append(row(key, None, f"offline round {i + 1}", walls[i] if i < len(walls) else None, it))
    return [r for r in rows if r is not None]


def failing_load(rows: Sequence[Mapping[str, Any]], search: int = 0) -> float | None:
    """The lowest load of `search` where Chariot failed and vLLM ran too; else the highest load both ran."""
    probes = [r for r in rows if r["qps"] is not None and r["search"] == search]
    ran = {s: {r["qps"] for r in probes if r["system"] == s} for s in ("chariot", "vllm")}
    both = ran["chariot"] & ran["vllm"]
    failed = sorted(r["qps"] for r in probes
                    if r["system"] == "chariot" and r["verdict"] != "pass" and r["qps"] in both)
    if failed:
        return failed[0]
    return max(both) if both else None


def _cdf(hist: Mapping[str, int]) -> tuple[list[float], list[float]]:
    ordered = sorted(hist.items(), key=lambda kv: math.inf if kv[0] == "+Inf" else float(kv[0]))
    total = sum(n for _, n in ordered)
    xs: list[float] = []
    ys: list[float] = []
    seen = 0
    for le, n in ordered:
        seen += n
        xs.append(float(le) if le != "+Inf" else xs[-1] * 1.1)
        ys.append(seen / total)
    return xs, ys


def plot(doc: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], out: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    colours = {"chariot": "tab:blue", "vllm": "tab:orange"}
    for system, colour in colours.items():
        pts = [(r["qps"], r["tokens_mean"], r["verdict"] == "pass") for r in rows
               if r["system"] == system and r["qps"] is not None]
        left.scatter([q for q, _, ok in pts if ok], [m for _, m, ok in pts if ok], c=colour, marker="o",
                     label=f"{system}, passed")
        left.scatter([q for q, _, ok in pts if not ok], [m for _, m, ok in pts if not ok], c=colour, marker="x",
                     label=f"{system}, failed")
    left.set_xlabel("offered load (QPS)")
    left.set_ylabel("tokens per iteration (mean)")
    left.set_title("iteration size against load, every search")
    left.legend(fontsize=8)
    qps = failing_load(rows)
    if qps is not None:
        for run in doc["runs"]:
            probe = next((p for p in run["probes"] if p["qps"] == qps), None)
            it = probe.get("iterations") if probe else None
            if run.get("search", 0) != 0 or not it or not it.get("histogram"):
                continue
            xs, ys = _cdf(it["histogram"])
            right.step(xs, ys, where="post", c=colours.get(run["system"]),
                       label=f"{run['system']} ({it['iterations']} iterations, mean {it['tokens_mean']:.0f})")
        right.set_xscale("log", base=2)
        right.set_xlabel("tokens in the iteration")
        right.set_ylabel("share of iterations")
        right.set_title(f"at {qps:g} QPS, first search")
        right.legend(fontsize=8)
    fig.suptitle("tokens per iteration, from each server's per-iteration log")
    fig.tight_layout()
    path = out / "iteration_mix.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.2f}" if x < 10 else f"{x:.0f}"
    if isinstance(x, dict):
        return "/".join(_fmt(v) for v in x.values())
    return str(x)


def main(argv: Sequence[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    src = Path(argv[0])
    out = Path(argv[1]) if len(argv) > 1 else src.parent
    out.mkdir(parents=True, exist_ok=True)
    doc = load(src)
    rows = report(doc)
    (out / "iteration_mix.json").write_text(json.dumps({"source": src.name, "rows": rows}, indent=1) + "\n")
    for r in rows:
        extra = " ".join(f"{k} {_fmt(r[k])}" for k in SERVER_ONLY_KEYS if k in r)
        print(f"{r['variant']} s{r['search'] + 1} {r['system']:8} {_fmt(r['qps']) if r['qps'] else 'offline':>7} "
              f"{r['verdict']:16} it {r['iterations']:5} it/s {_fmt(r['iterations_per_s'])} tokens mean "
              f"{_fmt(r['tokens_mean'])} p10/50/90 {_fmt(r['tokens_p10'])}/{_fmt(r['tokens_p50'])}/"
              f"{_fmt(r['tokens_p90'])} with prompt {_fmt(r['share_with_prompt'])} full {_fmt(r['share_full'])} "
              f"prefill {_fmt(r['prefill'])} decodes {_fmt(r['decodes'])} forward ms {_fmt(r['forward_ms'])} "
              f"({_fmt(r['forward_s'])} s) full {_fmt(r['full_forward_ms'])} decode-only "
              f"{_fmt(r['decode_only_forward_ms'])} {extra}")
    print(plot(doc, rows, out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
