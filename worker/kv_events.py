"""KV events: which prefix-cache blocks a worker holds, as a numbered stream for routers.

The block manager notes every block hash it registers (stored) and every registered block whose room
it takes back (removed), coalesced until the engine core drains them once per step (a dict write per
block, nothing per token). The serving process appends each step's non-empty batch to a `KVEventLog`
under the next sequence number and keeps, from those batches alone, the set of hashes cached now, so
a snapshot needs nothing from the engine (whose loop may run in another process).

A subscriber (the `KvEvents` RPC) names the last sequence number it applied and the boot id it got
it from. It gets a snapshot (every cached hash, with the sequence number it reflects) when it has
applied nothing, comes from another boot of the worker, or asks for a gap older than the bounded
log (`max_batches` recent batches); otherwise the batches after its number. Then it is woken per
new batch. With no subscriber, appending costs the batch and the cached-set update, no wake-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import uuid
from collections import deque
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

DEFAULT_LOG_BATCHES = 4096
"""Recent batches a subscriber can catch up from without a snapshot."""


@dataclass(frozen=True)
class KVEventBatch:
    """One step's changes: hashes newly registered (chain order) and hashes evicted; disjoint."""

    sequence: int
    stored: tuple[bytes, ...]
    removed: tuple[bytes, ...]


@dataclass(frozen=True)
class KVSnapshot:
    """Every hash cached once the batches up to `sequence` were applied."""

    sequence: int
    hashes: tuple[bytes, ...]


class KVEventLog:
    """Numbered KV event batches, the cached set they add up to, and their subscribers.

    `append` may be called from any one thread (the engine's or the pipe reader's); subscribers run
    on asyncio event loops.
    """

    def __init__(self, block_size: int, max_batches: int | None = None, boot_id: str | None = None) -> None:
        max_batches = DEFAULT_LOG_BATCHES if max_batches is None else max_batches
        if max_batches < 1:
            raise ValueError(f"max_batches must be >= 1, got {max_batches}")
        self.block_size = block_size
        self.boot_id = boot_id or uuid.uuid4().hex
        self.sequence = 0
        self._log: deque[KVEventBatch] = deque(maxlen=max_batches)
        self._cached: dict[bytes, None] = {}  # insertion order: oldest registration first
        self._lock = threading.Lock()
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()
        self._closed = False

    # ---- the producer ------------------------------------------------------------------------
    def append(self, stored: Iterable[bytes], removed: Iterable[bytes]) -> KVEventBatch | None:
        """Record one step's changes under the next sequence number (nothing when both are empty)."""
        stored, removed = tuple(stored), tuple(removed)
        if not stored and not removed:
            return None
        with self._lock:
            self.sequence += 1
            batch = KVEventBatch(self.sequence, stored, removed)
            self._log.append(batch)
            for h in removed:
                self._cached.pop(h, None)
            for h in stored:
                self._cached[h] = None
            waiters = list(self._waiters)
        _wake(waiters)
        return batch

    def close(self) -> None:
        """End every subscription (the server is stopping)."""
        with self._lock:
            self._closed = True
            waiters = list(self._waiters)
        _wake(waiters)

    # ---- the consumers -----------------------------------------------------------------------
    def since(self, sequence: int) -> list[KVEventBatch] | None:
        """The batches after `sequence`, or None when the log no longer holds them all."""
        with self._lock:
            return self._since(sequence)

    def snapshot(self) -> KVSnapshot:
        with self._lock:
            return KVSnapshot(self.sequence, tuple(self._cached))

    def num_cached(self) -> int:
        return len(self._cached)

    def num_batches(self) -> int:
        return len(self._log)

    async def subscribe(self, last_sequence: int = 0, boot_id: str = "") -> AsyncIterator[KVSnapshot | KVEventBatch]:
        """A snapshot if the subscriber cannot continue from `last_sequence` of `boot_id` (see the module
        docstring), then every batch after it as it comes, until `close`."""
        woken = asyncio.Event()
        waiter = (asyncio.get_running_loop(), woken)
        with self._lock:
            self._waiters.add(waiter)
            resumable = last_sequence > 0 and boot_id == self.boot_id and last_sequence <= self.sequence
            pending = self._since(last_sequence) if resumable else None
            first: KVSnapshot | None = None
            if self._closed:
                return
            if pending is None:
                first = KVSnapshot(self.sequence, tuple(self._cached))
                pending = []
        try:
            cursor = last_sequence
            if first is not None:
                yield first
                cursor = first.sequence
            while True:
                for batch in pending:
                    if batch.sequence > cursor:
                        yield batch
                        cursor = batch.sequence
                await woken.wait()
                woken.clear()
                with self._lock:
                    if self._closed:
                        return
                    more = self._since(cursor)
                    snap = KVSnapshot(self.sequence, tuple(self._cached)) if more is None else None
                if snap is not None:  # fell further behind than the log reaches
                    yield snap
                    cursor, pending = snap.sequence, []
                else:
                    pending = more or []
        finally:
            with self._lock:
                self._waiters.discard(waiter)

    def _since(self, sequence: int) -> list[KVEventBatch] | None:
        if sequence >= self.sequence:
            return []
        if not self._log or self._log[0].sequence > sequence + 1:
            return None
        return list(itertools.islice(self._log, sequence + 1 - self._log[0].sequence, None))


def _wake(waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]) -> None:
    for loop, event in waiters:
        with contextlib.suppress(RuntimeError):  # that subscriber's loop is closed
            loop.call_soon_threadsafe(event.set)
