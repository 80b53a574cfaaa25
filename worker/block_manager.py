"""Paged KV-cache bookkeeping: fixed-size blocks, per-sequence block tables, a free list.

Only stage 0 owns this state; other pipeline stages get block tables and slot mappings in each
micro-batch's metadata. No tensors here: the cache itself lives with the executor.
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    """Allocates cache blocks of `block_size` tokens to sequences.

    Invariants (checked by `check_invariants`): every block is either free or owned by exactly
    one sequence; a sequence's table covers at least the tokens it was grown to.
    The watermark keeps a few blocks back from *admissions* so running decodes can still grow
    without immediately preempting.
    """

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.watermark_blocks = int(watermark * num_blocks)
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[int, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_admit(self, num_tokens: int) -> bool:
        """Whether a new sequence of `num_tokens` fits while keeping the watermark free."""
        return self.num_free_blocks - self.blocks_for(num_tokens) >= self.watermark_blocks

    def can_grow(self, seq_id: int, num_tokens: int) -> bool:
        return self._missing(seq_id, num_tokens) <= self.num_free_blocks

    def allocate(self, seq_id: int, num_tokens: int) -> None:
        """Give a new sequence a table covering `num_tokens` tokens."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id} already has blocks")
        self._tables[seq_id] = []
        self.grow(seq_id, num_tokens)

    def grow(self, seq_id: int, num_tokens: int) -> None:
        """Extend the sequence's table to cover `num_tokens` tokens."""
        missing = self._missing(seq_id, num_tokens)
        if missing > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: need {missing}, have {self.num_free_blocks}")
        table = self._tables[seq_id]
        table.extend(self._free.popleft() for _ in range(missing))

    def free(self, seq_id: int) -> None:
        """Return the sequence's blocks (no-op if it holds none)."""
        self._free.extend(self._tables.pop(seq_id, ()))

    def has_blocks(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def block_table(self, seq_id: int) -> list[int]:
        return self._tables[seq_id]

    def owners(self) -> dict[int, list[int]]:
        return {sid: list(t) for sid, t in self._tables.items()}

    def _missing(self, seq_id: int, num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(self._tables.get(seq_id, ())))

    def check_invariants(self) -> None:
        """Raise AssertionError if a block is lost, duplicated or double-owned."""
        owned = [b for t in self._tables.values() for b in t]
        every = owned + list(self._free)
        if len(every) != self.num_blocks or set(every) != set(range(self.num_blocks)):
            raise AssertionError(
                f"block accounting broken: {len(owned)} owned + {len(self._free)} free "
                f"!= {self.num_blocks} distinct blocks"
            )
