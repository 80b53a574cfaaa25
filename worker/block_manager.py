"""Paged KV-cache bookkeeping: fixed-size blocks, per-sequence block tables, a free pool, and
automatic prefix caching.

Only stage 0 owns this state; other pipeline stages get block tables and slot mappings in each
micro-batch's metadata. No tensors here: the cache itself lives with the executor.

Prefix caching: once a block is full of computed tokens it is registered under a hash of its tokens
chained with the hash of every block before it (`contracts/prefix_hash.py`, the chain the router's
prefix index uses too), so equal hashes mean equal token prefixes and therefore equal KV (the model
is fixed for the engine's life). A new sequence whose prompt starts
with registered blocks shares them (reference counts) and skips that part of its prefill. A block
nobody references any more keeps its KV and its registration until its room is needed: fresh
allocations take never-registered blocks first, then evict registered ones least recently freed
first, the tail blocks of a sequence before its head.

KV events: with prefix caching on, every registration (stored) and every registration ended by an
eviction (removed) is noted, coalesced per hash (its last change wins), until `drain_events` takes
them; the engine core drains once per step (`worker/kv_events.py`).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from chariot.contracts.prefix_hash import ROOT, block_hash, iter_block_hashes, max_cached_blocks

TokenSlice = Callable[[int, int], Sequence[int]]
"""Tokens [start, stop) of a sequence (`Sequence.token_slice`)."""


@dataclass(frozen=True)
class PrefixHit:
    """Registered blocks that hold the first `len(blocks)` full blocks of a token sequence.

    Never the whole sequence: at least one token is left to compute, so the prefill that follows
    produces the logits of the last token.
    """

    blocks: tuple[int, ...] = ()
    hashes: tuple[bytes, ...] = ()
    block_size: int = 1

    @property
    def num_tokens(self) -> int:
        return len(self.blocks) * self.block_size


NO_HIT = PrefixHit()


class BlockManager:
    """Allocates cache blocks of `block_size` tokens to sequences.

    Invariants (checked by `check_invariants`): a block's reference count is the number of tables
    holding it; a block is free exactly when its count is 0, in the plain pool if it is not
    registered and in the evictable pool if it is; the registry maps hashes to blocks one to one.
    A sequence's table covers at least the tokens it was grown to.
    The watermark keeps a few blocks back from *admissions* so running decodes can still grow
    without immediately preempting.
    """

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01,
                 prefix_caching: bool = False) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.watermark_blocks = int(watermark * num_blocks)
        self.prefix_caching = prefix_caching
        # free, not registered; taken from the right, most recently freed first, so a cache that is
        # not full keeps reusing the same pages: its memory stays resident and warm, and a CPU cache
        # (left uninitialised) page-faults only as far as the peak usage reaches.
        self._plain: deque[int] = deque(reversed(range(num_blocks)))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free, registered; oldest first
        self._refs = [0] * num_blocks
        self._tables: dict[int, list[int]] = {}
        self._seq_hashes: dict[int, list[bytes]] = {}  # hashes of each sequence's full computed blocks
        self._registry: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._events: dict[bytes, bool] = {}  # hash -> registered (True) or evicted, since the last drain

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (registered ones included: their room can be taken)."""
        return len(self._plain) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Registered blocks, held or not."""
        return len(self._registry)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix caching ----------------------------------------------------------------------
    def cached_prefix(self, tokens: Sequence[int]) -> PrefixHit:
        """The longest run of registered blocks that starts `tokens` (leaving at least one token)."""
        if not self.prefix_caching:
            return NO_HIT
        bs = self.block_size
        blocks: list[int] = []
        hashes: list[bytes] = []
        for h in iter_block_hashes(tokens, bs, max_cached_blocks(len(tokens), bs)):
            block = self._registry.get(h)
            if block is None:
                break
            blocks.append(block)
            hashes.append(h)
        return PrefixHit(tuple(blocks), tuple(hashes), bs) if blocks else NO_HIT

    def register_computed(self, seq_id: int, token_slice: TokenSlice, num_computed: int) -> None:
        """Register the sequence's blocks that `num_computed` computed tokens fill, so later
        sequences can share them. Call only once their KV is written on every stage."""
        if not self.prefix_caching or seq_id not in self._tables:
            return
        hashes, table, bs = self._seq_hashes[seq_id], self._tables[seq_id], self.block_size
        for i in range(len(hashes), min(num_computed // bs, len(table))):
            h = block_hash(hashes[-1] if hashes else ROOT, token_slice(i * bs, (i + 1) * bs))
            hashes.append(h)
            block = table[i]
            if h not in self._registry and block not in self._hash_of:
                self._registry[h] = block
                self._hash_of[block] = h
                self._events[h] = True

    def drain_events(self) -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
        """(stored, removed) hashes since the last drain, disjoint; stored in registration order."""
        if not self._events:
            return (), ()
        events, self._events = self._events, {}
        return (tuple(h for h, on in events.items() if on), tuple(h for h, on in events.items() if not on))

    def cached_hashes(self) -> list[bytes]:
        """Every registered hash (what a KV event snapshot holds)."""
        return list(self._registry)

    # ---- allocation --------------------------------------------------------------------------
    def _admission_cost(self, num_tokens: int, hit: PrefixHit) -> int:
        """Free blocks a new sequence takes: fresh ones past its hit, plus hit blocks nobody holds now
        (they leave the free pool when shared)."""
        revived = sum(1 for b in hit.blocks if self._refs[b] == 0)
        return self.blocks_for(num_tokens) - len(hit.blocks) + revived

    def can_admit(self, num_tokens: int, hit: PrefixHit = NO_HIT) -> bool:
        """Whether a new sequence of `num_tokens` (sharing `hit`) fits while keeping the watermark free."""
        return self.num_free_blocks - self._admission_cost(num_tokens, hit) >= self.watermark_blocks

    def covers(self, seq_id: int, num_tokens: int) -> bool:
        """Whether the sequence's table already holds `num_tokens` tokens (growing it takes nothing)."""
        return self._missing(seq_id, num_tokens) == 0

    def can_grow(self, seq_id: int, num_tokens: int) -> bool:
        return self._missing(seq_id, num_tokens) <= self.num_free_blocks

    def allocate(self, seq_id: int, num_tokens: int, hit: PrefixHit = NO_HIT) -> None:
        """Give a new sequence a table covering `num_tokens` tokens whose first blocks are `hit`'s."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id} already has blocks")
        cost = self._admission_cost(num_tokens, hit)
        if cost > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: need {cost}, have {self.num_free_blocks}")
        for block in hit.blocks:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
        self._tables[seq_id] = list(hit.blocks)
        self._seq_hashes[seq_id] = list(hit.hashes)
        self.grow(seq_id, num_tokens)

    def grow(self, seq_id: int, num_tokens: int) -> None:
        """Extend the sequence's table to cover `num_tokens` tokens."""
        missing = self._missing(seq_id, num_tokens)
        if missing > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: need {missing}, have {self.num_free_blocks}")
        self._tables[seq_id].extend(self._take_free() for _ in range(missing))

    def free(self, seq_id: int) -> None:
        """Drop the sequence's hold on its blocks (no-op if it holds none); registered blocks keep
        their KV for later hits until their room is needed."""
        self._seq_hashes.pop(seq_id, None)
        for block in reversed(self._tables.pop(seq_id, ())):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._evictable[block] = None
                else:
                    self._plain.append(block)

    def _take_free(self) -> int:
        """A block for new KV: the most recently freed unregistered one if any, else the least
        recently freed registered one, whose registration ends here."""
        if self._plain:
            block = self._plain.pop()
        else:
            block, _ = self._evictable.popitem(last=False)
            h = self._hash_of.pop(block)
            del self._registry[h]
            self._events[h] = False
        self._refs[block] = 1
        return block

    def has_blocks(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def block_table(self, seq_id: int) -> list[int]:
        return self._tables[seq_id]

    def owners(self) -> dict[int, list[int]]:
        return {sid: list(t) for sid, t in self._tables.items()}

    def _missing(self, seq_id: int, num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(self._tables.get(seq_id, ())))

    def check_invariants(self) -> None:
        """Raise AssertionError if a block is lost, duplicated, miscounted or misregistered."""
        refs = [0] * self.num_blocks
        for table in self._tables.values():
            if len(set(table)) != len(table):
                raise AssertionError(f"a table holds a block twice: {table}")
            for block in table:
                refs[block] += 1
        if refs != self._refs:
            raise AssertionError("reference counts do not match the tables")
        free = set(self._plain) | set(self._evictable)
        if len(free) != self.num_free_blocks or free != {b for b in range(self.num_blocks) if refs[b] == 0}:
            raise AssertionError(
                f"block accounting broken: {len(self._plain)} plain + {len(self._evictable)} evictable free "
                f"blocks, {sum(1 for r in refs if r == 0)} unreferenced"
            )
        if any(b in self._hash_of for b in self._plain) or any(b not in self._hash_of for b in self._evictable):
            raise AssertionError("a free block sits in the wrong pool for its registration")
        if {h: b for b, h in self._hash_of.items()} != self._registry:
            raise AssertionError("the prefix registry and the block hashes disagree")
