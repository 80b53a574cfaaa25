"""What each server's iterations carried during one probe, read from the servers themselves.

Why: a probe's client-side token times show when tokens came, not how many prompt tokens each
iteration computed; whether a queue grew because iterations carried few tokens or because they were
slow needs the server's own count. Both systems report it, each in its own way, and this module turns
both into the same histogram of tokens per iteration over the same bounds:

- Chariot: the iteration log (`--iteration-log`, `chariot.worker.iteration_log`), one line per
  iteration, read from the byte offset where the previous probe stopped. It also gives the prompt
  tokens, decodes, step time and queue of each iteration.
- vLLM: its Prometheus histogram `vllm:iteration_tokens_total` (prompt tokens computed plus tokens
  generated per engine step), scraped from `/metrics` before and after the probe, with bucket bounds
  set at start-up (`--custom-histogram-buckets`) fine enough to read per-token counts up to 64 and
  16-token bins above. The histogram is kept by vLLM's API server from the stats its engine core
  sends anyway; the engine's loop does no more work with finer buckets.
"""

from __future__ import annotations

import bisect
import json
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

VLLM_ITERATION_TOKENS = "vllm:iteration_tokens"  # the histogram family, without the `_total` of its samples
FINE_UP_TO = 64  # every token count up to here has its own bucket (a decode-only iteration's batch)
COARSE_STEP = 16


def token_bounds(token_budget: int) -> list[int]:
    """Histogram bounds for tokens per iteration: 1..64 one by one, then every 16 up to the budget, and
    the budget itself (no iteration carries more)."""
    return sorted({*range(1, FINE_UP_TO + 1), *range(FINE_UP_TO, token_budget, COARSE_STEP), token_budget})


def vllm_bucket_flag(token_budget: int) -> list[str]:
    """vLLM's flag that sets its iteration-token histogram to `token_bounds`."""
    bounds = [float(b) for b in token_bounds(token_budget)]
    return ["--custom-histogram-buckets", json.dumps({"iteration_tokens": bounds}, separators=(",", ":"))]


def histogram(token_counts: Sequence[int], bounds: Sequence[int]) -> dict[str, int]:
    """Iterations per bucket, keyed by the bucket's upper bound (`le`; "+Inf" past the last bound)."""
    counts: dict[str, int] = {}
    for tokens in token_counts:
        i = bisect.bisect_left(bounds, tokens)
        key = str(bounds[i]) if i < len(bounds) else "+Inf"
        counts[key] = counts.get(key, 0) + 1
    return counts


def bucket_quantile(counts: Mapping[str, int], q: float) -> float | None:
    """The upper bound of the bucket holding quantile `q` (exact for counts up to `FINE_UP_TO`)."""
    ordered = sorted(counts.items(), key=lambda kv: math.inf if kv[0] == "+Inf" else float(kv[0]))
    total = sum(n for _, n in ordered)
    if total == 0:
        return None
    rank, seen = q * total, 0
    for le, n in ordered:
        seen += n
        if seen >= rank and n:
            return math.inf if le == "+Inf" else float(le)
    return None


def histogram_summary(counts: Mapping[str, int], token_sum: float, token_budget: int) -> dict[str, Any]:
    """Iterations, tokens per iteration (mean, p10/p50/p90 by bucket), and the share of iterations that
    carried more than a decode batch's worth (> 64 tokens: prompt chunks) and that filled the budget."""
    total = sum(counts.values())
    over_fine = sum(n for le, n in counts.items() if le == "+Inf" or float(le) > FINE_UP_TO)
    full = sum(n for le, n in counts.items() if le == "+Inf" or float(le) >= token_budget)
    return {"iterations": total, "tokens": token_sum, "tokens_mean": token_sum / total if total else None,
            **{f"tokens_p{int(q * 100)}": bucket_quantile(counts, q) for q in (0.1, 0.5, 0.9)},
            "share_over_64": over_fine / total if total else None, "share_full": full / total if total else None}


class IterationSource(Protocol):
    """Per probe: `take()` before it (dropping what came before) and after it (what it caused)."""

    def take(self) -> dict[str, Any]: ...


def _quantiles(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None}
    ordered = sorted(values)
    return {"p50": statistics.median(ordered), "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]}


class ChariotIterations:
    """Reads Chariot's iteration log from where the last `take` stopped."""

    def __init__(self, path: Path, token_budget: int) -> None:
        self.path, self.token_budget, self.offset = path, token_budget, 0

    def take(self) -> dict[str, Any]:
        from chariot.worker.iteration_log import read_iterations

        if not self.path.exists():
            return {"source": "chariot --iteration-log", "error": f"{self.path} not written"}
        records, self.offset = read_iterations(self.path, self.offset)
        tokens = [r["tokens"] for r in records]
        counts = histogram(tokens, token_bounds(self.token_budget))
        return {"source": "chariot --iteration-log", "log": self.path.name,
                "span": [records[0]["t"], records[-1]["t"]] if records else None,
                "histogram": counts, **histogram_summary(counts, sum(tokens), self.token_budget),
                "prefill": _quantiles([r["prefill"] for r in records if r["prefill"]]),
                "decodes": _quantiles([r["decodes"] for r in records]),
                "ms": _quantiles([r["ms"] for r in records]),
                "waiting": _quantiles([r["waiting"] for r in records]),
                "prompt_chunks_per_prefill_iteration": _quantiles([len(r["chunks"]) for r in records if r["chunks"]])}


def parse_vllm_histogram(text: str, family: str = VLLM_ITERATION_TOKENS) -> tuple[dict[str, float], float]:
    """Cumulative bucket counts by `le` and the sum of a Prometheus histogram in exposition text
    (summed over label sets other than `le`: one engine here)."""
    from prometheus_client.parser import text_string_to_metric_families

    cumulative: dict[str, float] = {}
    total = 0.0
    for fam in text_string_to_metric_families(text):
        if fam.name not in (family, f"{family}_total"):
            continue
        for sample in fam.samples:
            if sample.name.endswith("_bucket"):
                le = sample.labels["le"]
                key = le if le == "+Inf" else f"{float(le):g}"
                cumulative[key] = cumulative.get(key, 0.0) + sample.value
            elif sample.name.endswith("_sum"):
                total += sample.value
    return cumulative, total


def bucket_counts(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, int]:
    """Per-bucket counts of the observations between two scrapes of cumulative buckets."""
    def order(le: str) -> float:
        return math.inf if le == "+Inf" else float(le)

    counts, below = {}, 0.0
    for le in sorted(after, key=order):
        cumulative = after[le] - before.get(le, 0.0)
        if cumulative - below > 0:
            counts[le] = round(cumulative - below)
        below = cumulative
    return counts


class VllmIterations:
    """Scrapes vLLM's iteration-token histogram; `take` returns what changed since the last scrape."""

    def __init__(self, base_url: str, token_budget: int) -> None:
        self.base_url, self.token_budget = base_url, token_budget
        self.last: tuple[dict[str, float], float] = ({}, 0.0)

    def scrape(self) -> tuple[dict[str, float], float]:
        import httpx

        return parse_vllm_histogram(httpx.get(f"{self.base_url}/metrics", timeout=30.0).text)

    def take(self) -> dict[str, Any]:
        try:
            now = self.scrape()
        except Exception as exc:  # a scrape that fails loses this probe's histogram, not the run
            return {"source": "vllm /metrics", "error": f"{type(exc).__name__}: {exc}"[:300]}
        (before, sum_before), (after, sum_after) = self.last, now
        self.last = now
        if not after:
            return {"source": "vllm /metrics", "error": f"no {VLLM_ITERATION_TOKENS} histogram served"}
        counts = bucket_counts(before, after)
        return {"source": "vllm /metrics", "histogram": counts,
                **histogram_summary(counts, sum_after - sum_before, self.token_budget)}
