"""Tensor parallelism inside a pipeline stage: which slice of every weight a rank holds, and the two
collectives the sharded layers need.

Why a module of its own: the shard arithmetic (heads, KV heads, MLP columns, vocabulary rows) is
pure and shared by the model (parameter shapes), the loader (which slice of each checkpoint tensor
to read) and the KV cache (how many KV heads a rank stores), so it lives in one place that tests
can call without a process group. The layout is Megatron's: q/k/v and gate/up are column-parallel
(each rank computes its heads / its MLP columns), o_proj and down_proj row-parallel (each rank
holds the matching input columns, and one all-reduce per block sums the partial outputs), the
embedding and LM head vocabulary-parallel (masked lookup + all-reduce; logits all-gathered for
sampling). KV heads are split across ranks, or replicated when there are fewer KV heads than
ranks (each rank then keeps the one KV head its query heads use), as vLLM does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from chariot.contracts.errors import ConfigError
from chariot.contracts.parallelism import tensor_split_problem
from chariot.worker.config import ModelConfig


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `size` tensor-parallel ranks of one stage: the ranges of a model it holds."""

    rank: int = 0
    size: int = 1

    def check(self, model: ModelConfig) -> None:
        """Raise ConfigError (naming tensor_parallel_size) unless `model` splits evenly over `size`."""
        if not 0 <= self.rank < max(self.size, 1):
            raise ConfigError("tensor_parallel_size", f"rank {self.rank} is not in [0, {self.size})")
        problem = tensor_split_problem(self.size, model.num_heads, model.num_kv_heads, model.intermediate_size)
        if problem is not None:
            raise ConfigError("tensor_parallel_size", problem)

    def heads(self, model: ModelConfig) -> range:
        """The query heads this rank computes."""
        n = model.num_heads // self.size
        return range(self.rank * n, (self.rank + 1) * n)

    def kv_heads(self, model: ModelConfig) -> range:
        """The KV heads this rank stores: its share, or the one its query heads read (replicated)."""
        kv = model.num_kv_heads
        if kv >= self.size:
            n = kv // self.size
            return range(self.rank * n, (self.rank + 1) * n)
        head = self.rank * kv // self.size
        return range(head, head + 1)

    def mlp(self, model: ModelConfig) -> range:
        """The MLP (intermediate) columns this rank computes."""
        n = model.intermediate_size // self.size
        return range(self.rank * n, (self.rank + 1) * n)

    def vocab(self, model: ModelConfig) -> range:
        """The vocabulary rows this rank holds: ceil(vocab / size) each, the last ones padded."""
        n = self.vocab_rows(model)
        return range(self.rank * n, min((self.rank + 1) * n, model.vocab_size))

    def vocab_rows(self, model: ModelConfig) -> int:
        return -(-model.vocab_size // self.size)


NO_SHARD = Shard()


class Collectives:
    """The collectives of one stage's tensor-parallel group; with one rank, no-ops."""

    def __init__(self, shard: Shard = NO_SHARD, group: dist.ProcessGroup | None = None) -> None:
        if shard.size > 1 and group is None:
            raise ValueError("a tensor-parallel group of more than one rank needs its process group")
        self.shard, self.group = shard, group
        self._timed_s = 0.0  # finished collectives (all-reduces, the logits all-gather)
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # CUDA ones not yet read

    @property
    def size(self) -> int:
        return self.shard.size

    @property
    def collective_s(self) -> float:
        """Seconds spent in this rank's collectives so far, waits for slower ranks included.

        On the CPU (gloo) a collective returns when it is done, so wall time around the call is its
        time. On CUDA the call only enqueues it: CUDA events on the stream around it time the
        collective itself, and reading this waits for the ones still running (the engine reads it
        after an iteration's sampled tokens have come back, when they are done anyway)."""
        for start, end in self._pending:
            end.synchronize()
            self._timed_s += start.elapsed_time(end) / 1e3
        self._pending.clear()
        return self._timed_s

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks (in place), returned for chaining."""
        if self.size > 1:
            with _Timer(self, x.device):
                dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along the last dimension, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        with _Timer(self, x.device):
            dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


class _Timer:
    """Times one collective into its owner: wall time on the CPU, CUDA events on the stream on a GPU."""

    def __init__(self, owner: Collectives, device: torch.device) -> None:
        self.owner, self.cuda = owner, device.type == "cuda"

    def __enter__(self) -> None:
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()

    def __exit__(self, *_: object) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.owner._pending.append((self.start, end))
        else:
            self.owner._timed_s += time.perf_counter() - self.t0


SINGLE = Collectives()
