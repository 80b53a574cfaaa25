"""What each server's iterations carried during one probe, read from the servers' own logs.

Why: a probe's client-side token times show when tokens came, not how many prompt tokens each
iteration computed; whether a queue grew because iterations carried few tokens or because they were
slow needs the servers' own count. Both systems log one line per iteration when asked, and this
module reads both into the same record and the same summary:

- Chariot: its iteration log (`--iteration-log`, `chariot.worker.iteration_log`), JSON lines.
- vLLM: its per-iteration log lines (`--enable-logging-iteration-details`, in vLLM's log): the
  scheduler's context (prompt) requests and tokens, generation (decode) requests and tokens, and the
  time its engine loop waited for the forward pass. vLLM's Prometheus histogram
  `vllm:iteration_tokens_total` is not used: under chunked prefill it counts a prompt's tokens in the
  step its last chunk finishes, none in the steps before.

A record: `prefill` (prompt tokens), `decodes` (decode sequences), `tokens` (both), `forward_ms` (the
forward pass as the engine loop waited for it: Chariot's `exec_ms`, vLLM's "iteration elapsed
time"), `kv_usage` (the share of the KV cache in use, 0-1, None where the log has none: Chariot's
`kv`, vLLM's "KV cache usage"), and for Chariot `waiting` (requests not yet started after the
iteration). Each source is read from the byte offset where the previous `take` stopped, so a take
before a probe drops what came before (warm-up, the other phase) and a take after it returns the
probe's.
"""

from __future__ import annotations

import bisect
import gzip
import json
import math
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from chariot.worker.iteration_log import read_new_lines

FINE_UP_TO = 64  # every token count up to here has its own bucket (a decode-only iteration's batch)
COARSE_STEP = 16
VLLM_ITERATION_FLAG = "--enable-logging-iteration-details"
VLLM_ITERATION_LINE = re.compile(
    r"Iteration\((?P<index>\d+)\): (?P<ctx_requests>\d+) context requests, (?P<ctx_tokens>\d+) context tokens, "
    r"(?P<gen_requests>\d+) generation requests, (?P<gen_tokens>\d+) generation tokens, "
    r"iteration elapsed time: (?P<ms>[\d.]+) ms(?P<dummy> \(dummy\))?"
    r"(?:, (?:CPU |GPU )?KV cache usage: (?P<kv>[\d.]+)%)?")


def token_bounds(token_budget: int) -> list[int]:
    """Histogram bounds for tokens per iteration: 1..64 one by one, then every 16 up to the budget, and
    the budget itself (no iteration carries more)."""
    return sorted({*range(1, FINE_UP_TO + 1), *range(FINE_UP_TO, token_budget, COARSE_STEP), token_budget})


def histogram(token_counts: Sequence[int], bounds: Sequence[int]) -> dict[str, int]:
    """Iterations per bucket, keyed by the bucket's upper bound ("+Inf" past the last bound)."""
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


def quantiles(values: Sequence[float]) -> dict[str, float | None]:
    """Median and nearest-rank p90."""
    if not values:
        return {"p50": None, "p90": None}
    ordered = sorted(values)
    return {"p50": statistics.median(ordered), "p90": ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]}


def summary(records: Sequence[Mapping[str, Any]], token_budget: int) -> dict[str, Any]:
    """Iterations; tokens per iteration (histogram over `token_bounds`, mean, p10/p50/p90); the share
    carrying prompt tokens and the share that filled the budget; prompt tokens of the iterations that
    had some, decodes and forward time (p50/p90), and their sums; the forward time of the iterations
    that filled the budget (the prefill rate under a queue) and of those with decodes alone."""
    tokens = [r["tokens"] for r in records]
    counts = histogram(tokens, token_bounds(token_budget))
    n = len(records)
    return {"iterations": n, "histogram": counts, "tokens": sum(tokens), "tokens_mean": sum(tokens) / n if n else None,
            **{f"tokens_p{int(q * 100)}": bucket_quantile(counts, q) for q in (0.1, 0.5, 0.9)},
            "share_with_prompt": sum(r["prefill"] > 0 for r in records) / n if n else None,
            "share_full": sum(t >= token_budget for t in tokens) / n if n else None,
            "prefill_tokens": sum(r["prefill"] for r in records),
            "prefill": quantiles([r["prefill"] for r in records if r["prefill"]]),
            "decodes": quantiles([r["decodes"] for r in records]),
            "forward_ms": quantiles([r["forward_ms"] for r in records]),
            "forward_s": round(sum(r["forward_ms"] for r in records) / 1e3, 3),
            "full_forward_ms": quantiles([r["forward_ms"] for r in records if r["tokens"] >= token_budget]),
            "decode_only_forward_ms": quantiles([r["forward_ms"] for r in records if not r["prefill"]]),
            **({"waiting": quantiles([r["waiting"] for r in records])}
               if records and all("waiting" in r for r in records) else {})}


@dataclass(frozen=True)
class StepCost:
    """An iteration's time as a server's log shows it: `constant_ms` + `prompt_token_ms` per prompt
    token + `decode_ms` per decode, fitted by least squares over `iterations` records (R² `r2`)."""

    constant_ms: float
    prompt_token_ms: float
    decode_ms: float
    r2: float
    iterations: int

    def predict_ms(self, prompt_tokens: float, decodes: float) -> float:
        return self.constant_ms + self.prompt_token_ms * prompt_tokens + self.decode_ms * decodes


def fit_step_cost(records: Iterable[Mapping[str, Any]], time_key: str = "forward_ms") -> StepCost:
    """`StepCost` of records with `prefill`, `decodes` and the time `time_key` (ms). A coefficient that
    comes out negative is dropped (held at 0) and the others refitted, so the model never predicts
    less time for more work."""
    rows = [(float(r["prefill"]), float(r["decodes"]), float(r[time_key])) for r in records]
    if len(rows) < 3:
        raise ValueError(f"need at least 3 iterations to fit a step cost, got {len(rows)}")
    x = np.array([[1.0, p, d] for p, d, _ in rows])
    y = np.array([ms for _, _, ms in rows])
    keep = [0, 1, 2]
    while True:
        coef, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
        if (coef >= 0).all() or len(keep) == 1:
            break
        keep.pop(int(np.argmin(coef)))
    full = np.zeros(3)
    full[keep] = np.clip(coef, 0.0, None)
    residual = y - x @ full
    r2 = 1.0 - float(residual @ residual) / max(float(((y - y.mean()) ** 2).sum()), 1e-30)
    return StepCost(float(full[0]), float(full[1]), float(full[2]), r2, len(rows))


class IterationSource(Protocol):
    """Per probe: `take()` before it (dropping what came before) and after it (what it caused)."""

    def take(self) -> dict[str, Any]: ...


class LogIterations:
    """Reads one server's iteration lines from where the last `take` stopped."""

    source = ""

    def __init__(self, path: Path, token_budget: int) -> None:
        self.path, self.token_budget, self.offset = path, token_budget, 0

    def parse(self, lines: Sequence[str]) -> list[dict[str, Any]]:
        raise NotImplementedError

    def take(self) -> dict[str, Any]:
        if not self.path.exists():
            return {"source": self.source, "error": f"{self.path} not written"}
        lines, self.offset = read_new_lines(self.path, self.offset)
        return {"source": self.source, "log": self.path.name, **summary(self.parse(lines), self.token_budget)}


def read_log_lines(path: Path) -> list[str]:
    """Every line of a whole log, gzipped (`.gz`) or not (the committed raw data is gzipped)."""
    with (gzip.open(path, "rt", errors="replace") if path.name.endswith(".gz")
          else path.open(errors="replace")) as f:
        return f.read().splitlines()


def chariot_records(lines: Sequence[str]) -> list[dict[str, Any]]:
    """Chariot's iteration-log lines as they were written (`worker.iteration_log.iteration_record`)."""
    return [json.loads(line) for line in lines if line.strip()]


def parse_chariot(lines: Sequence[str]) -> list[dict[str, Any]]:
    """Records (see the module docstring) of Chariot's iteration-log lines."""
    return [{"prefill": r["prefill"], "decodes": r["decodes"], "tokens": r["tokens"], "forward_ms": r["exec_ms"],
             "kv_usage": r.get("kv"), "waiting": r["waiting"]} for r in chariot_records(lines)]


def parse_vllm(lines: Sequence[str]) -> list[dict[str, Any]]:
    """Records of vLLM's per-iteration log lines among its other lines (dummy iterations left out)."""
    records = []
    for line in lines:
        found = VLLM_ITERATION_LINE.search(line)
        if found is None or found["dummy"]:
            continue
        prefill, gen = int(found["ctx_tokens"]), int(found["gen_tokens"])
        records.append({"prefill": prefill, "decodes": int(found["gen_requests"]), "tokens": prefill + gen,
                        "forward_ms": float(found["ms"]),
                        "kv_usage": float(found["kv"]) / 100 if found["kv"] is not None else None})
    return records


class ChariotIterations(LogIterations):
    """Chariot's `--iteration-log` file."""

    source = "chariot --iteration-log"

    def parse(self, lines: Sequence[str]) -> list[dict[str, Any]]:
        return parse_chariot(lines)


class VllmIterations(LogIterations):
    """vLLM's log with `--enable-logging-iteration-details` (dummy iterations left out)."""

    source = f"vllm {VLLM_ITERATION_FLAG}"

    def __init__(self, path: Path, token_budget: int) -> None:
        super().__init__(path, token_budget)
        self.offset = path.stat().st_size if path.exists() else 0  # earlier phases appended to the same log

    def parse(self, lines: Sequence[str]) -> list[dict[str, Any]]:
        return parse_vllm(lines)
