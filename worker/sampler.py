"""Batched next-token sampling for one iteration (runs on the last pipeline stage).

Why a module of its own: every iteration turns one row of logits per scheduled sequence into a token,
and two properties must hold whatever the batch looks like:

- Greedy rows (temperature 0) are the exact argmax of their logits, untouched by other rows; a batch
  of only greedy rows costs one argmax (no softmax, no sort).
- A request with a `seed` gets the same k-th token no matter which rows share its batch, where it sits
  in the batch, or whether it was preempted and recomputed.

Sampling uses the exponential race: the argmax of `probs / E` with `E ~ Exp(1)` i.i.d. per token is a
draw from `probs` (E is made as -log U, U uniform). Temperatures below `GREEDY_TEMPERATURE` count as
greedy. Only rows that use top-k/top-p are ranked, and with top-k alone only `topk`, not a full sort.
The noise of a seeded row depends only on (seed, step), so its draw is a function of
its own logits and (seed, step); unseeded rows share one draw from the sampler's own generator.
Everything is batched tensor ops except generating the noise of seeded rows (one small generator each).

Before any of that, a batch may carry sparse logit adjustments (`LogitAdjustments`: logit_bias,
presence/frequency penalties and the min_tokens ban, worked out by stage 0, which holds each
request's output so far); they apply to greedy and sampled rows alike. Rows that asked for logprobs
get them from the raw logits, before adjustments, temperature or filtering (`SamplerOutput`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import torch

from chariot.contracts.outputs import TokenLogprobs
from chariot.contracts.sampling_params import SamplingParams

# Temperatures below this are treated as greedy: dividing by them would overflow to inf/NaN.
GREEDY_TEMPERATURE = 1e-5
# Temperatures above this behave as uniform sampling anyway; capping keeps them finite in float32.
MAX_TEMPERATURE = 1e30

_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # odd: seed * _GOLDEN is a bijection mod 2**64


def row_seed(seed: int, step: int) -> int:
    """The generator seed for a seeded request's `step`-th token: splitmix64(seed, step), 63 bits.

    Deterministic across processes and platforms, so the token depends only on (seed, step, logits).
    """
    x = (seed * _GOLDEN + step) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & _MASK63


@dataclass(frozen=True)
class LogitAdjustments:
    """Sparse additions to one batch's logits: `deltas[j]` is added to logit `token_ids[j]` of row
    `rows[j]` (repeats add up; -inf bans a token). Rows index the batch's sampled rows."""

    rows: tuple[int, ...] = ()
    token_ids: tuple[int, ...] = ()
    deltas: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not len(self.rows) == len(self.token_ids) == len(self.deltas):
            raise ValueError("logit adjustment columns of unequal length")

    def __len__(self) -> int:
        return len(self.rows)

    @classmethod
    def for_rows(cls, rows: Sequence[tuple[SamplingParams, Sequence[int]]],
                 banned_until_min: Collection[int]) -> LogitAdjustments:
        """The adjustments of rows given as (params, output token ids so far); `banned_until_min` are
        the EOS ids (the request's stop token ids are added), unsampleable before `min_tokens`."""
        out: tuple[list[int], list[int], list[float]] = ([], [], [])
        for row, (params, output) in enumerate(rows):
            for token, delta in _row_adjustments(params, output, banned_until_min):
                out[0].append(row)
                out[1].append(token)
                out[2].append(delta)
        return cls(tuple(out[0]), tuple(out[1]), tuple(out[2]))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` (float32, [rows, V]) with the adjustments added, in place."""
        if self.rows:
            dev = logits.device
            index = (torch.tensor(self.rows, device=dev), torch.tensor(self.token_ids, device=dev))
            logits.index_put_(index, torch.tensor(self.deltas, dtype=logits.dtype, device=dev), accumulate=True)
        return logits


def _row_adjustments(params: SamplingParams, output: Sequence[int],
                     banned_until_min: Collection[int]) -> list[tuple[int, float]]:
    pairs = list(params.logit_bias)
    if params.penalized and output:
        fp, pp = params.frequency_penalty, params.presence_penalty
        pairs += [(token, -(fp * count + pp)) for token, count in Counter(output).items()]
    if len(output) < params.min_tokens:
        eos = () if params.ignore_eos else banned_until_min
        pairs += [(token, float("-inf")) for token in {*eos, *params.stop_token_ids}]
    return pairs


@dataclass(frozen=True)
class SamplingColumns:
    """Per-row sampling parameters as plain host values, one column per field: what a packed
    micro-batch carries (`chariot.worker.micro_batch`) and what a `SamplingBatch` is built from.

    `steps[i]` is how many tokens row i's request has generated so far (the index of the token
    being sampled); `logprobs[i]` how many alternatives row i wants with its logprob (None: no
    logprobs).
    """

    temperatures: tuple[float, ...]
    top_ks: tuple[int, ...]
    top_ps: tuple[float, ...]
    seeds: tuple[int | None, ...]
    steps: tuple[int, ...]
    logprobs: tuple[int | None, ...]
    adjustments: LogitAdjustments = field(default_factory=LogitAdjustments)

    def __post_init__(self) -> None:
        n = len(self.steps)
        columns = (self.temperatures, self.top_ks, self.top_ps, self.seeds, self.logprobs)
        if any(len(col) != n for col in columns):
            raise ValueError(f"sampling columns of unequal length for {n} steps")
        if min(self.steps, default=0) < 0:
            raise ValueError(f"steps must be >= 0, got {list(self.steps)}")

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], steps: Sequence[int],
                    adjustments: LogitAdjustments | None = None) -> SamplingColumns:
        """Rows `params[i]` at generation step `steps[i]`."""
        if len(params) != len(steps):
            raise ValueError(f"got {len(params)} sampling params but {len(steps)} steps")
        return cls(
            temperatures=tuple(float(p.temperature) for p in params),
            top_ks=tuple(p.top_k for p in params),
            top_ps=tuple(float(p.top_p) for p in params),
            seeds=tuple(p.seed for p in params),
            steps=tuple(int(s) for s in steps),
            logprobs=tuple(p.logprobs for p in params),
            adjustments=adjustments or LogitAdjustments(),
        )

    @property
    def logprob_width(self) -> int | None:
        """The most alternatives any row asked for (None: no row wants logprobs)."""
        return max((k for k in self.logprobs if k is not None), default=None)


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters of one iteration, as device tensors plus host-side facts.

    Row i describes row i of the logits. `steps[i]` is how many tokens that request has generated
    so far (the index of the token being sampled). The host-side row sets let the sampler pick its
    path without device syncs: greedy rows never reach the sampling code, rows without top-k/top-p
    are never sorted.
    """

    columns: SamplingColumns  # the exact host values it was built from (seeds and steps among them)
    sample_rows: tuple[int, ...]  # non-greedy rows
    filter_rows: tuple[int, ...]  # non-greedy rows that use top-k or top-p (subset of sample_rows)
    top_k_bound: int | None  # max top_k of filter_rows when all use top-k (no full sort), else None
    packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # [N] int64 each, on the sampling device:
    # temperature and top-p as float64 bit patterns, top-k (a packed micro-batch's own sections)

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        steps: Sequence[int],
        device: torch.device | str | None = None,
    ) -> SamplingBatch:
        """Build the batch for rows `params[i]` at generation step `steps[i]`."""
        return cls.from_columns(SamplingColumns.from_params(params, steps), device)

    @classmethod
    def from_columns(cls, cols: SamplingColumns, device: torch.device | str | None = None) -> SamplingBatch:
        """Build the batch from host columns."""
        bits = torch.tensor([cols.temperatures, cols.top_ps], dtype=torch.float64).view(torch.int64)
        packed = torch.stack([bits[0], _tensor(cols.top_ks, torch.int64, None), bits[1]])
        packed = packed if device is None else packed.to(device)
        return cls.from_packed(cols, (packed[0], packed[1], packed[2]))

    @classmethod
    def from_packed(cls, cols: SamplingColumns, packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                    ) -> SamplingBatch:
        """Build the batch from host columns and the same temperatures, top-k and top-p already on
        the sampling device as `packed` holds them. Device tensors derived from them are made on
        first use: an all-greedy batch makes none, and needs no per-row Python work."""
        sample_rows = [] if max(cols.temperatures, default=0.0) < GREEDY_TEMPERATURE else [
            i for i, t in enumerate(cols.temperatures) if t >= GREEDY_TEMPERATURE]
        filter_rows = [i for i in sample_rows if cols.top_ks[i] > 0 or cols.top_ps[i] < 1.0]
        ks = [cols.top_ks[i] for i in filter_rows]
        return cls(cols, tuple(sample_rows), tuple(filter_rows), max(ks) if ks and min(ks) > 0 else None, packed)

    @cached_property
    def temperatures(self) -> torch.Tensor:
        """[N] float32; 0 for greedy rows, else the temperature capped to stay finite in float32."""
        temperatures = self.packed[0].view(torch.float64)
        capped = temperatures.clamp(max=MAX_TEMPERATURE)
        return torch.where(temperatures < GREEDY_TEMPERATURE, 0.0, capped).to(torch.float32)

    @property
    def top_ks(self) -> torch.Tensor:
        """[N] int64; 0 = off."""
        return self.packed[1]

    @cached_property
    def top_ps(self) -> torch.Tensor:
        """[N] float32; 1.0 = off."""
        return self.packed[2].view(torch.float64).to(torch.float32)

    @cached_property
    def sample_index(self) -> torch.Tensor:
        """[len(sample_rows)] int64: sample_rows on the device."""
        return _tensor(self.sample_rows, torch.int64, self.packed[0].device)

    @cached_property
    def filter_index(self) -> torch.Tensor:
        """[len(filter_rows)] int64: their positions within sample_rows."""
        position = {row: j for j, row in enumerate(self.sample_rows)}
        return _tensor([position[row] for row in self.filter_rows], torch.int64, self.packed[0].device)

    @property
    def seeds(self) -> tuple[int | None, ...]:
        return self.columns.seeds

    @property
    def adjustments(self) -> LogitAdjustments:
        return self.columns.adjustments

    @property
    def steps(self) -> tuple[int, ...]:
        return self.columns.steps

    @property
    def num_rows(self) -> int:
        return len(self.steps)

    @property
    def all_greedy(self) -> bool:
        return not self.sample_rows


def _tensor(values: Sequence[float], dtype: torch.dtype, device: torch.device | str | None) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


@dataclass(frozen=True)
class SamplerOutput:
    """One batch's sampled tokens, and the logprobs of the rows that asked (`SamplingColumns.logprobs`).

    `logprobs[i, 0]` is the logprob of `token_ids[i]`, `logprobs[i, 1 + j]` that of `top_ids[i, j]`,
    the j-th most likely token; width K = `SamplingColumns.logprob_width`. Rows that did not ask
    hold values to ignore. Both are None when no row asked.
    """

    token_ids: torch.Tensor  # [N] int64
    logprobs: torch.Tensor | None = None  # [N, 1 + K] float32
    top_ids: torch.Tensor | None = None  # [N, K] int64
    host_copy: SamplerOutput | None = field(default=None, repr=False, compare=False)
    """Pinned host tensors a copy started by `prefetch` is writing (None: no copy started)."""
    copied: Any = field(default=None, repr=False, compare=False)
    """The CUDA event recorded after that copy."""

    def prefetch(self) -> SamplerOutput:
        """Start copying a CUDA output into pinned host memory, without waiting: `to_host` then waits
        for this copy alone, not for work the device was given after it (the next batch, when the
        engine schedules ahead). An output elsewhere is returned as it is."""
        if self.token_ids.device.type != "cuda" or self.host_copy is not None:
            return self
        token_ids = _pinned_copy(self.token_ids)
        logprobs = None if self.logprobs is None else _pinned_copy(self.logprobs)
        top_ids = None if self.top_ids is None else _pinned_copy(self.top_ids)
        event = torch.cuda.Event()
        event.record()
        return replace(self, host_copy=SamplerOutput(token_ids, logprobs, top_ids), copied=event)

    def to_host(self) -> SamplerOutput:
        """This output on the host: one device-to-host copy per tensor, not one per row (itself when
        it is there already; the prefetched copy once it has landed)."""
        if self.host_copy is not None:
            self.copied.synchronize()
            return self.host_copy
        if self.token_ids.device.type == "cpu" and (self.logprobs is None or self.logprobs.device.type == "cpu"):
            return self
        if self.logprobs is None or self.top_ids is None:
            return SamplerOutput(self.token_ids.cpu())
        return SamplerOutput(self.token_ids.cpu(), self.logprobs.cpu(), self.top_ids.cpu())

    def logprobs_of(self, row: int, wanted: int | None) -> TokenLogprobs | None:
        """Row `row`'s token logprob and its `wanted` likeliest alternatives (None if it asked for none)."""
        if wanted is None or self.logprobs is None or self.top_ids is None:
            return None
        lps, ids = self.logprobs[row].tolist(), self.top_ids[row, :wanted].tolist()
        return TokenLogprobs(int(self.token_ids[row]), lps[0], tuple(zip(ids, lps[1 : 1 + wanted], strict=True)))


def _pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A pinned host tensor the device is copying `tensor` into (asynchronously)."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([N, 1 + width] logprobs: the chosen token's, then the `width` most likely; [N, width] their ids)."""
    logp = logits.float().log_softmax(dim=-1)
    top, ids = logp.topk(width, dim=-1) if width else (logp[:, :0], tokens[:, None][:, :0])
    return torch.cat([logp.gather(1, tokens[:, None]), top], dim=1), ids


class Sampler:
    """Turns a [N, V] logits batch into N token ids (and logprobs where asked); see the module
    docstring.

    `seed` seeds the generator used for rows without their own seed, so a whole engine run is
    reproducible given the same schedule.
    """

    def __init__(self, seed: int = 0) -> None:
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != batch.num_rows:
            raise ValueError(f"logits {tuple(logits.shape)} do not match {batch.num_rows} batch rows")
        width = batch.columns.logprob_width
        raw = logits
        if len(batch.adjustments):  # on a copy: the caller's (raw) logits stay as they are
            logits = batch.adjustments.apply(logits.float().clone())
        tokens = self._tokens(logits, batch)
        if width is None:
            return SamplerOutput(tokens)
        return SamplerOutput(tokens, *logprobs_of(raw, tokens, width))

    def _tokens(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if batch.all_greedy:
            return logits.argmax(dim=-1)
        all_sampled = len(batch.sample_rows) == batch.num_rows
        rows = logits if all_sampled else logits.index_select(0, batch.sample_index)
        sampled = self._sample(rows.float(), batch)
        if all_sampled:
            return sampled
        return logits.argmax(dim=-1).index_copy_(0, batch.sample_index, sampled)

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Sample the non-greedy rows (`logits` holds exactly `batch.sample_rows`)."""
        idx = batch.sample_index
        scaled = logits / batch.temperatures.index_select(0, idx).unsqueeze(1)
        if batch.filter_rows:
            scaled = _filter_rows(scaled, batch)
        probs = scaled.softmax(dim=-1)
        # Race: argmax p / E with E = -log U ~ Exp(1) is argmin p / log U (log U < 0 as U < 1).
        return probs.div_(self._log_uniform(probs, batch)).argmin(dim=-1)

    def _log_uniform(self, probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """log U, U ~ Uniform[0, 1), shaped like `probs`: per (seed, step) for seeded rows.

        (`uniform_` + `log_` is several times faster than `exponential_` on CPU.)
        """
        noise = torch.empty_like(probs)
        if any(batch.seeds[r] is None for r in batch.sample_rows):
            noise.uniform_(generator=self._generator(probs.device))
        for i, r in enumerate(batch.sample_rows):
            seed = batch.seeds[r]
            if seed is not None:
                gen = torch.Generator(device=probs.device).manual_seed(row_seed(seed, batch.steps[r]))
                noise[i].uniform_(generator=gen)
        return noise.log_()

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device).manual_seed(self._seed)
            self._generators[device] = gen
        return gen


def _filter_rows(scaled: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Apply top-k/top-p to the rows of `scaled` (the sample rows) that use them, and only those."""
    if len(batch.filter_rows) == len(batch.sample_rows):
        rows, pos = scaled, None
    else:
        pos = batch.filter_index
        rows = scaled.index_select(0, pos)
    ids = batch.sample_index if pos is None else batch.sample_index.index_select(0, pos)
    ks, ps = batch.top_ks.index_select(0, ids), batch.top_ps.index_select(0, ids)
    filtered = apply_top_k_top_p(rows, ks, ps, batch.top_k_bound)
    return filtered if pos is None else scaled.index_copy_(0, pos, filtered)


def apply_top_k_top_p(
    logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, k_bound: int | None = None
) -> torch.Tensor:
    """Set logits outside each row's top-k, then outside its nucleus, to -inf.

    `top_ks[i] == 0` disables top-k; `top_ps[i] == 1` disables top-p. The nucleus is the smallest
    set of most likely tokens (after top-k) whose probability mass is >= top_p; the top token is
    always kept. `k_bound`, when given, promises every row has `0 < top_k <= k_bound`: only the top
    `k_bound` candidates are then ranked (`topk`) instead of sorting the whole vocabulary.
    """
    vocab = logits.shape[-1]
    width = vocab if k_bound is None else min(k_bound, vocab)
    if width == vocab:
        values, order = logits.sort(dim=-1, descending=True)
    else:
        values, order = logits.topk(width, dim=-1)
    ranks = torch.arange(width, device=logits.device).unsqueeze(0)
    k = torch.where(top_ks > 0, top_ks.clamp(max=width), width).unsqueeze(1)
    drop = ranks >= k
    values.masked_fill_(drop, float("-inf"))
    probs = values.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # exactly 0 for the top token
    p = torch.where(top_ps < 1.0, top_ps, float("inf")).unsqueeze(1)
    values.masked_fill_(mass_before >= p, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, order, values)
