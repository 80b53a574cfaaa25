"""One JSON line per engine iteration: what each iteration carried and how long it took.

Why: the metrics (`observe.py`) fold iterations into histograms, which say how batches are made up on
average but not what happened at one load, in order — whether the prompt queue grew because
iterations carried few prompt tokens, because they were slow, or because prompts arrived faster than
any budget drains them. A benchmark that drives a known load (`chariot bench peer`) turns this log on
with `--iteration-log FILE` and slices it by probe. It is a step observer like the metrics: it runs in
the serving front, reads only the `StepResult` it is handed, and never slows the engine's loop.

A line (keys are short: a loaded server writes tens of lines per second):

- `t`: wall-clock time (`time.time()`) the step ended;
- `ms`: the step's wall time, and `exec_ms` / `host_ms` its forward pass and the rest (schedule,
  input preparation, postprocess), in milliseconds;
- `tokens`, `prefill`, `decodes`: the batch's tokens, its prompt tokens, its decode sequences;
- `chunks`: the prompt chunks' sizes in batch order; `last`: how many of them end their prompt;
- `preempted`: sequences evicted while building the batch;
- `waiting`, `running`, `queued_prefill`, `kv`: the load after the step (requests not yet started,
  requests in progress, prompt tokens still to compute, KV-cache use in [0, 1]).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from chariot.contracts.engine_settings import ITERATION_LOG
from chariot.contracts.errors import ConfigError
from chariot.contracts.outputs import RequestOutput
from chariot.worker.engine_output import StepResult


def iteration_record(result: StepResult) -> dict[str, Any] | None:
    """The log line of one step as a dict; None for a step that completed no batch."""
    batch, times, load = result.batch, result.times, result.stats
    if batch is None:
        return None
    prompt_chunks = batch.chunks[batch.num_decodes:]
    return {
        "t": round(result.ended_at, 4),
        "ms": round(times.total * 1e3, 2),
        "exec_ms": round(times.execute * 1e3, 2),
        "host_ms": round((times.total - times.execute) * 1e3, 2),
        "tokens": batch.num_tokens,
        "prefill": batch.num_prefill_tokens,
        "decodes": batch.num_decodes,
        "chunks": [c.num_tokens for c in prompt_chunks],
        "last": sum(c.samples for c in prompt_chunks),
        "preempted": len(batch.preempted),
        "waiting": load.num_waiting,
        "running": load.num_running,
        "queued_prefill": load.queued_prefill_tokens,
        "kv": round(load.kv_cache_usage, 4),
    }


class IterationLog:
    """Step observer appending `iteration_record` lines to `path` (created with its folder; appended
    to, so a restarted engine continues the file). Each line is flushed as written: a reader sees
    every step that has been observed."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file: IO[str] = self.path.open("a", encoding="utf-8")
        except OSError as exc:
            why = exc.strerror or exc
            raise ConfigError(ITERATION_LOG.name, f"cannot append to {str(self.path)!r}: {why}") from exc
        self._lock = threading.Lock()

    def __call__(self, result: StepResult, outputs: Sequence[RequestOutput]) -> None:
        record = iteration_record(result)
        if record is None:
            return
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with self._lock:
            if not self._file.closed:
                self._file.write(line)
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_new_lines(path: str | Path, offset: int = 0) -> tuple[list[str], int]:
    """The whole lines written to `path` from byte `offset` on, and the offset after the last of them
    (a line still being written is left for the next read)."""
    with Path(path).open("rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1
    return data[:end].decode("utf-8", errors="replace").splitlines(), offset + end


def read_iterations(path: str | Path, offset: int = 0) -> tuple[list[dict[str, Any]], int]:
    """The records written to `path` from byte `offset` on, and the offset after the last whole line."""
    lines, end = read_new_lines(path, offset)
    return [json.loads(line) for line in lines if line.strip()], end


def iteration_log_path(base: str | Path, replica: int) -> Path:
    """Where replica `replica` of `chariot up` logs when the user asked for `base`: the replica's index
    before the suffix (`iterations.jsonl` → `iterations.0.jsonl`)."""
    base = Path(base)
    return base.with_name(f"{base.stem}.{replica}{base.suffix}")


class StepObservers:
    """Several step observers as one, called in order (the metrics, then the iteration log)."""

    def __init__(self, *observers: Any) -> None:
        self.observers = tuple(o for o in observers if o is not None)

    def __call__(self, result: StepResult, outputs: Sequence[RequestOutput]) -> None:
        for observer in self.observers:
            observer(result, outputs)
