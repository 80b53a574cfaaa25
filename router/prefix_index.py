"""Which prompt prefixes each replica holds in its KV cache, as the router knows them.

Per replica, the set of block hashes (the chain of `contracts/prefix_hash.py`, with the engine's block
size) that the replica has registered in its prefix cache. KV events from the workers keep it
current: `add_blocks` for blocks stored, `remove_blocks` for blocks evicted, `reset_replica` for a
snapshot after missed events, `drop_replica` when a replica's event stream resets (a restarted worker
holds nothing). A prompt is hashed once (`hash_prompt`); `cached_tokens` then tells, per replica, how
many of its leading tokens that replica would serve from its cache: the longest run of the chain
present from the first block, in whole blocks, leaving at least one token to compute, exactly as the
worker's `BlockManager.cached_prefix` counts them.

The block size is the engines': the index starts at the engine default and adopts what the first
replica's KV event stream announces (`use_block_size`, see `kv_events.py`).

Memory is bounded: each replica keeps at most `capacity` hashes (the router lowers it to the
replica's number of KV blocks once its load report says so: it cannot cache more) and, past it, forgets the least
recently used first (O(1) per block). Within one `add_blocks` call the earlier hashes count as more
recently used, so a chain registered head first loses its tail before its head, as on the worker
(a tail without its head serves nothing). A lookup touches nothing; after routing a prompt to a
replica, `add_blocks(replica, hashes)` records what it will hold once prefilled and refreshes the
prefix it reused (the replica's own events confirm or correct it).

Not thread-safe: the router calls it from its event loop.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from chariot.contracts.prefix_hash import DEFAULT_BLOCK_SIZE, block_hashes, max_cached_blocks

DEFAULT_CAPACITY_BLOCKS = 1 << 16
"""Hashes remembered per replica unless told otherwise (about 10 MiB per replica)."""


@dataclass(frozen=True)
class PromptHashes:
    """A prompt's block hashes, computed once and reused by every replica's lookup."""

    hashes: tuple[bytes, ...]  # one per full block of the prompt
    num_tokens: int
    block_size: int

    @property
    def reusable(self) -> int:
        """Leading blocks a cache may serve (at least one prompt token is always computed)."""
        return min(len(self.hashes), max_cached_blocks(self.num_tokens, self.block_size))


@dataclass
class _Replica:
    capacity: int
    blocks: OrderedDict[bytes, None] = field(default_factory=OrderedDict)  # least recently used first
    evicted: int = 0  # hashes forgotten for capacity (not evicted by the replica)


class PrefixIndex:
    """Per-replica block hashes with LRU-bounded memory, and the longest cached prefix per replica."""

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, capacity: int = DEFAULT_CAPACITY_BLOCKS) -> None:
        if block_size < 1 or capacity < 1:
            raise ValueError(f"block_size and capacity must be >= 1, got {block_size}, {capacity}")
        self.block_size = block_size
        self.capacity = capacity
        self._replicas: dict[str, _Replica] = {}

    # ---- the prompt side ---------------------------------------------------------------------
    def hash_prompt(self, token_ids: Sequence[int]) -> PromptHashes:
        """The chained hashes of every full block of the prompt (what the replica that prefills it
        registers), computed once per request."""
        return PromptHashes(tuple(block_hashes(token_ids, self.block_size)), len(token_ids), self.block_size)

    def cached_tokens(self, prompt: PromptHashes, replicas: Iterable[str] | None = None) -> dict[str, int]:
        """Per replica (`replicas`, default every indexed one; an unknown replica holds nothing), how
        many leading prompt tokens its cache would serve: whole blocks of the longest present chain
        prefix."""
        if prompt.block_size != self.block_size:
            raise ValueError(f"prompt hashed with block size {prompt.block_size}, the index uses {self.block_size}")
        names = self._replicas if replicas is None else replicas
        hashes = prompt.hashes[:prompt.reusable]
        out: dict[str, int] = {}
        for name in names:
            replica = self._replicas.get(name)
            out[name] = 0 if replica is None else _prefix_blocks(replica.blocks, hashes) * self.block_size
        return out

    def lookup(self, token_ids: Sequence[int],
               replicas: Iterable[str] | None = None) -> tuple[PromptHashes, dict[str, int]]:
        """`hash_prompt` then `cached_tokens`: the hashes (to reuse) and the cached tokens per replica."""
        prompt = self.hash_prompt(token_ids)
        return prompt, self.cached_tokens(prompt, replicas)

    # ---- the event side ----------------------------------------------------------------------
    def add_blocks(self, replica: str, hashes: Sequence[bytes]) -> None:
        """The replica holds these blocks (a "stored" event, or a prompt just routed to it). Each
        becomes most recently used, earlier ones more recent than later ones; past the capacity the
        least recently used are forgotten."""
        state = self._replica(replica)
        blocks = state.blocks
        for h in reversed(hashes):
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
                if len(blocks) > state.capacity:
                    blocks.popitem(last=False)
                    state.evicted += 1

    def remove_blocks(self, replica: str, hashes: Iterable[bytes]) -> None:
        """The replica evicted these blocks (unknown ones are ignored)."""
        state = self._replicas.get(replica)
        if state is None:
            return
        for h in hashes:
            state.blocks.pop(h, None)

    def drop_replica(self, replica: str) -> None:
        """Forget everything about the replica (its event stream reset, it restarted or left)."""
        self._replicas.pop(replica, None)

    def reset_replica(self, replica: str, hashes: Sequence[bytes]) -> None:
        """Replace what the replica holds by a snapshot (after missed events); keeps its capacity."""
        state = self._replica(replica)
        state.blocks.clear()
        self.add_blocks(replica, hashes)

    def set_capacity(self, replica: str, capacity: int) -> None:
        """Bound this replica's hashes (e.g. by its number of KV blocks), forgetting the least recently
        used ones beyond it now."""
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        state = self._replica(replica)
        if state.capacity == capacity:
            return
        state.capacity = capacity
        while len(state.blocks) > capacity:
            state.blocks.popitem(last=False)
            state.evicted += 1

    def use_block_size(self, block_size: int) -> None:
        """Hash blocks of `block_size` tokens from now on (the replicas' engines use it). Every hash
        held so far names blocks of the old size, so all of them are forgotten; capacities stay."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        for state in self._replicas.values():
            state.blocks.clear()

    def accepts(self, prompt: PromptHashes) -> bool:
        """Whether `prompt` was hashed with this index's current block size."""
        return prompt.block_size == self.block_size

    # ---- introspection -----------------------------------------------------------------------
    def replicas(self) -> list[str]:
        return list(self._replicas)

    def num_blocks(self, replica: str | None = None) -> int:
        """Hashes held for one replica, or for all of them."""
        if replica is not None:
            state = self._replicas.get(replica)
            return 0 if state is None else len(state.blocks)
        return sum(len(s.blocks) for s in self._replicas.values())

    def capacity_of(self, replica: str) -> int:
        """The most hashes held for the replica (the index default for one not seen yet)."""
        state = self._replicas.get(replica)
        return self.capacity if state is None else state.capacity

    def num_evicted(self, replica: str) -> int:
        """Hashes this index forgot for the replica's capacity (not the replica's own evictions)."""
        state = self._replicas.get(replica)
        return 0 if state is None else state.evicted

    def holds(self, replica: str, block: bytes) -> bool:
        state = self._replicas.get(replica)
        return state is not None and block in state.blocks

    def lru_order(self, replica: str) -> list[bytes]:
        """The replica's hashes, least recently used (next to be forgotten) first."""
        state = self._replicas.get(replica)
        return [] if state is None else list(state.blocks)

    def _replica(self, name: str) -> _Replica:
        state = self._replicas.get(name)
        if state is None:
            state = self._replicas[name] = _Replica(self.capacity)
        return state


def _prefix_blocks(blocks: OrderedDict[bytes, None], hashes: Sequence[bytes]) -> int:
    """How many of `hashes`, from the first, are all in `blocks`."""
    for i, h in enumerate(hashes):
        if h not in blocks:
            return i
    return len(hashes)
