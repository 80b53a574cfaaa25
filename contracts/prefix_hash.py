"""The prefix hash chain: how a token sequence's full KV blocks are named, by the worker's prefix
cache (`worker/block_manager.py`) and by the router's per-replica prefix index alike.

A sequence is cut into blocks of `block_size` tokens; only full blocks are named. Block i's hash is a
keyed hash of its token ids whose key is block i−1's hash (the empty key for block 0), so equal hashes
mean equal token prefixes, not merely equal blocks. Both sides must use the same block size (the
engine's `--block-size`, `BLOCK_SIZE`) and this module's functions; a test checks that the router's
hashes are the block manager's keys.

A prompt may take at most `max_cached_blocks(len(prompt))` blocks from a cache: at least one token
is always computed, so the prefill produces the logits of the last prompt token.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterator, Sequence

from chariot.contracts.engine_settings import default_block_size

DEFAULT_BLOCK_SIZE: int = default_block_size("cpu")
"""The block size of the embedded default's CPU workers; a router's index takes each replica's own from
its KV events."""
HASH_BYTES = 16
ROOT = b""
"""The parent of a sequence's first block."""

_TOKEN_BYTES = array("q").itemsize
_FIRST_RUN_BLOCKS = 4


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Hash of one full block chained to its predecessors' (`parent`, `ROOT` for the first block).

    A keyed cryptographic hash, not Python's `hash`: a crafted prompt must not collide with another
    user's prefix and read its KV.
    """
    return hashlib.blake2b(array("q", tokens).tobytes(), digest_size=HASH_BYTES, key=parent).digest()


def iter_block_hashes(tokens: Sequence[int], block_size: int, num_blocks: int | None = None,
                      parent: bytes = ROOT) -> Iterator[bytes]:
    """The chained hashes of the first `num_blocks` full blocks of `tokens` (all full blocks when
    None), lazily: a caller that stops at the first unknown hash pays for no more.

    Equal to chaining `block_hash` block by block. The token ids are packed in runs of blocks that
    double in length (not block by block, not all at once), so an early stop packs at most twice
    what it hashed.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    full = len(tokens) // block_size
    n = full if num_blocks is None else min(num_blocks, full)
    stride = block_size * _TOKEN_BYTES
    done, run = 0, _FIRST_RUN_BLOCKS
    while done < n:
        take = min(run, n - done)
        packed = memoryview(array("q", tokens[done * block_size:(done + take) * block_size]).tobytes())
        for start in range(0, take * stride, stride):
            parent = hashlib.blake2b(packed[start:start + stride], digest_size=HASH_BYTES, key=parent).digest()
            yield parent
        done, run = done + take, 2 * run


def block_hashes(tokens: Sequence[int], block_size: int = DEFAULT_BLOCK_SIZE,
                 num_blocks: int | None = None) -> list[bytes]:
    """The chained hashes of the full blocks of `tokens` (at most `num_blocks` of them)."""
    return list(iter_block_hashes(tokens, block_size, num_blocks))


def max_cached_blocks(num_tokens: int, block_size: int) -> int:
    """How many leading blocks of a `num_tokens`-token prompt a prefix cache may serve: whole blocks,
    leaving at least one token to compute."""
    return max(0, (num_tokens - 1) // block_size)
