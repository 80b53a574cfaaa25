"""Keeps the router's `PrefixIndex` current from each replica's KV event stream.

One task per replica in the registry (started and stopped with the registry's changes, like the Stats
poller's) calls the worker's `KvEvents` RPC on the replica's shared channel and applies what comes:
a snapshot replaces the replica's hashes (`reset_replica`), a batch removes and adds
(`remove_blocks`, `add_blocks`). The replica's hashes are dropped (`drop_replica`) whenever its
stream ends or breaks, when its boot id changes (a restarted worker holds nothing) and when a batch
does not follow the last one; the task then subscribes again with exponential backoff, from nothing,
so the first message is a snapshot. The index takes its block size from the replicas: a stream that
announces another size while no other replica is followed switches the index to it
(`PrefixIndex.use_block_size`); one that disagrees with the replicas already followed is not indexed
(its hashes would never match a prompt's) and is retried at the longest backoff.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

import grpc

from chariot.proto.chariot.v1 import generation_pb2 as pb
from chariot.router.prefix_index import PrefixIndex
from chariot.router.registry import RegistryChange, ReplicaRegistry
from chariot.router.upstream import ReplicaChannels, ReplicaUnavailable, cancel_tasks

log = logging.getLogger(__name__)

INITIAL_BACKOFF_S = 0.2
MAX_BACKOFF_S = 5.0


class KVEventSubscriber:
    """Follows every replica's KV events into `index` (see the module docstring)."""

    def __init__(self, registry: ReplicaRegistry, channels: ReplicaChannels, index: PrefixIndex, *,
                 initial_backoff_s: float = INITIAL_BACKOFF_S, max_backoff_s: float = MAX_BACKOFF_S) -> None:
        self._registry = registry
        self._channels = channels
        self.index = index
        self._initial_backoff_s = initial_backoff_s
        self._max_backoff_s = max_backoff_s
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.boot_ids: dict[str, str] = {}  # per replica, the boot its current stream comes from
        self.sequences: dict[str, int] = {}  # per replica, the last sequence number applied
        self.resets: dict[str, int] = {}  # per replica, snapshots applied
        self._running = False
        registry.subscribe(self._on_change)

    def start(self) -> None:
        self._running = True
        self._sync(self._registry.names())

    def connected(self, name: str) -> bool:
        """Whether the replica's stream is up and its snapshot applied."""
        return name in self.sequences

    async def aclose(self) -> None:
        self._running = False
        await cancel_tasks(self._tasks)

    # ---- one replica -------------------------------------------------------------------------
    async def _follow(self, name: str) -> None:
        backoff = self._initial_backoff_s
        try:
            while True:
                try:
                    call = self._channels.stub(name).KvEvents(pb.KvEventsRequest(last_sequence=0))
                    async for message in call:
                        if not self._apply(name, message):
                            backoff = self._max_backoff_s
                            call.cancel()
                            break
                        backoff = self._initial_backoff_s
                    else:
                        log.info("replica %s ended its KV event stream", name)
                except (grpc.aio.AioRpcError, ReplicaUnavailable) as exc:
                    if self.connected(name):
                        detail = f"{exc.code().name}" if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                        log.warning("replica %s: KV event stream broke (%s); its prefix index is dropped", name, detail)
                self._forget(name)
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, self._max_backoff_s)
        finally:
            self._forget(name)

    def _apply(self, name: str, message: Any) -> bool:
        """Apply one stream message; False when the stream must be dropped and opened again."""
        if message.block_size != self.index.block_size and not (self.sequences.keys() - {name}):
            log.info("replica %s hashes blocks of %d tokens: the prefix index follows (it used %d)",
                     name, message.block_size, self.index.block_size)
            self.index.use_block_size(int(message.block_size))
        if message.block_size != self.index.block_size:
            log.warning("replica %s hashes blocks of %d tokens, the router's index %d: not indexed",
                        name, message.block_size, self.index.block_size)
            return False
        boot = self.boot_ids.get(name)
        if boot is not None and boot != message.boot_id:
            log.info("replica %s restarted (boot %s, was %s); its prefix index is dropped", name, message.boot_id, boot)
            self.index.drop_replica(name)
            self.sequences.pop(name, None)
        self.boot_ids[name] = message.boot_id
        if message.snapshot:
            self.index.reset_replica(name, list(message.stored))
            self.resets[name] = self.resets.get(name, 0) + 1
        elif name not in self.sequences or message.sequence != self.sequences[name] + 1:
            log.warning("replica %s: KV event %d does not follow %s; resubscribing", name, message.sequence,
                        self.sequences.get(name))
            return False
        else:
            self.index.remove_blocks(name, message.removed)
            self.index.add_blocks(name, list(message.stored))
        self.sequences[name] = message.sequence
        return True

    def _forget(self, name: str) -> None:
        self.index.drop_replica(name)
        self.sequences.pop(name, None)

    # ---- the replica set ---------------------------------------------------------------------
    def _on_change(self, change: RegistryChange) -> None:
        if not self._running:
            return
        for name in (*change.removed, *change.changed):
            task = self._tasks.pop(name, None)
            if task is not None:
                task.cancel()
            self._forget(name)
            self.boot_ids.pop(name, None)
        self._sync(self._registry.names())

    def _sync(self, names: Iterable[str]) -> None:
        loop = asyncio.get_running_loop()
        for name in names:
            if name not in self._tasks:
                self._tasks[name] = loop.create_task(self._follow(name), name=f"kv-events-{name}")
