"""A Llama-family decoder *stage*: the layers [start, end) of a Llama / Mistral / Qwen2 model.

Pipeline parallelism splits the model by layers, so the unit of execution is a stage, not a whole
model: the first stage embeds token ids, the last one owns the final norm and the LM head, and
every stage runs its layers over one flattened varlen batch whose attention goes through the paged
KV cache (`chariot.kernels`). q/k/v and gate/up are fused into single matmuls (their checkpoint
tensors are copied into row slices at load time), which matters for CPU speed.

With tensor parallelism (`parallel.py`) a stage is one rank's shard of those layers: its heads, KV
heads, MLP columns and vocabulary rows, with one all-reduce after o_proj and one after down_proj.
`Collectives` with one rank (the default) makes every collective a no-op.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from chariot.contracts.errors import ConfigError, ModelLoadError
from chariot.contracts.parallelism import layer_prefix, stage_weight_names
from chariot.kernels import AttentionMetadata, empty_kv_cache, paged_attention
from chariot.kernels.layer_ops import add_rms_norm, rms_norm, rope_write_kv, silu_and_mul
from chariot.worker.config import ModelConfig, RopeScaling
from chariot.worker.model.parallel import NO_SHARD, SINGLE, Collectives, Shard

KVCache = tuple[torch.Tensor, torch.Tensor]


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as Hugging Face does, then scaled by the weight."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)  # one kernel (Triton on CUDA, C++ on the CPU)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`x += residual` in place (the residual stream; x must be the caller's own fresh tensor), then
        the norm of it: returns (norm, x), in one kernel on CUDA."""
        return add_rms_norm(x, residual, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """RoPE inverse frequencies (float32), with Llama-3 frequency scaling when configured."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryTable:
    """cos/sin for every position up to `max_position_embeddings`, computed once in float32.

    Kept outside the module's parameters and buffers so `Module.to(dtype)` never rounds it; a copy
    per (device, dtype) is made on first use.
    """

    def __init__(self, config: ModelConfig) -> None:
        inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        pos = torch.arange(config.max_position_embeddings, dtype=torch.float32, device="cpu")
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self._base = (emb.cos(), emb.sin())
        self._copies: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, head_dim] for the given positions (the RoPE kernels broadcast them over heads)."""
        key = (positions.device, dtype)
        table = self._copies.get(key)
        if table is None:
            cos0, sin0 = self._base
            table = (cos0.to(device=positions.device, dtype=dtype), sin0.to(device=positions.device, dtype=dtype))
            self._copies[key] = table
        cos, sin = table
        return cos[positions], sin[positions]


class Attention(nn.Module):
    """GQA self-attention with fused q/k/v, RoPE, and the paged KV cache."""

    def __init__(self, config: ModelConfig, tp: Collectives = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads = len(tp.shard.heads(config))
        self.num_kv_heads = len(tp.shard.kv_heads(config))
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = self.num_heads * config.head_dim, self.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        o_bias = config.qkv_bias and config.architecture != "Qwen2ForCausalLM"
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=o_bias)  # row-parallel: bias on rank 0 only

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Output rows [T, hidden], or only the rows `keep` selects ([N, hidden]): every row's k, v still
        goes to the cache, only o_proj is skipped for the others."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = q.view(t, self.num_heads, self.head_dim), k.view(t, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        # q, k rotated in place in the projection's output; k, v written to the cache (one kernel on CUDA)
        rope_write_kv(q, k, v.view(t, self.num_kv_heads, self.head_dim), cos, sin, k_cache, v_cache,
                      meta.slot_mapping)
        out = paged_attention(q, k_cache, v_cache, meta, scale=self.scale).reshape(t, self.q_size)
        return self.tp.all_reduce(self.o_proj(out if keep is None else out.index_select(0, keep)))


class MLP(nn.Module):
    """SwiGLU feed-forward with gate and up fused into one matmul."""

    def __init__(self, config: ModelConfig, tp: Collectives = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.intermediate_size = len(tp.shard.mlp(config))
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(silu_and_mul(self.gate_up_proj(x))))


class VocabEmbedding(nn.Module):
    """Token embedding over this rank's vocabulary rows: ids outside them give zeros, and the
    all-reduce adds the one rank that holds each id."""

    def __init__(self, config: ModelConfig, tp: Collectives = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.first = tp.shard.vocab(config).start
        self.weight = nn.Parameter(torch.empty(tp.shard.vocab_rows(config), config.hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.first
        outside = (local < 0) | (local >= self.weight.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(h.masked_fill(outside.unsqueeze(-1), 0))


class DecoderLayer(nn.Module):
    """Pre-norm attention block then pre-norm MLP block, each with a residual connection.

    The residual stream travels beside the hidden state, as in vLLM: a layer takes (h, residual) and
    returns (mlp output, residual) without adding them, and each residual add happens inside the next
    norm (`RMSNorm.add_forward`, one kernel on CUDA). The first layer of a stage gets residual None.
    """

    def __init__(self, config: ModelConfig, tp: Collectives = SINGLE) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, tp)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        residual: torch.Tensor | None = None,
        keep: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mlp output, residual) for every row, or for the rows `keep` selects only (the attention
        block still runs over every row, so every row's k, v reaches the cache)."""
        # Residual adds in place into each block's fresh output (addition is exact either way round);
        # `h` itself is only written when it is a block's output (residual given).
        if residual is None:
            x, residual = self.input_layernorm(h), h
        else:
            x, residual = self.input_layernorm.add_forward(h, residual)
        attn = self.self_attn(x, cos, sin, kv_cache, meta, keep)
        if keep is not None:
            residual = residual.index_select(0, keep)
        x, residual = self.post_attention_layernorm.add_forward(attn, residual)
        return self.mlp(x), residual


class LlamaStage(nn.Module):
    """Layers [start, end) of a Llama-family model, plus the embedding / head when at the ends."""

    def __init__(self, config: ModelConfig, start: int = 0, end: int | None = None, tp: Collectives = SINGLE) -> None:
        super().__init__()
        end = config.num_layers if end is None else end
        if not 0 <= start < end <= config.num_layers:
            raise ConfigError(
                "layer_range", f"must satisfy 0 <= start < end <= {config.num_layers}, got [{start}, {end})"
            )
        tp.shard.check(config)
        self.config, self.start, self.end, self.tp = config, start, end, tp
        self.embed_tokens = VocabEmbedding(config, tp) if start == 0 else None
        self.layers = nn.ModuleList(DecoderLayer(config, tp) for _ in range(start, end))
        last = end == config.num_layers
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if last else None
        vocab_rows = tp.shard.vocab_rows(config)
        self.lm_head = nn.Linear(config.hidden_size, vocab_rows, bias=False) if last else None
        self.rotary = RotaryTable(config)
        self.requires_grad_(False)
        self.tie_weights()

    @property
    def is_first(self) -> bool:
        return self.embed_tokens is not None

    @property
    def is_last(self) -> bool:
        return self.lm_head is not None

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the checkpoint ties them (call after `to_empty`)."""
        if self.config.tie_word_embeddings and self.embed_tokens is not None and self.lm_head is not None:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        input_ids: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
        sampled_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run this stage's layers; returns hidden states [T, hidden] (not final-normed).

        `sampled_rows` (the last stage only): the rows whose logits will be taken. The last layer then
        runs its o_proj and MLP over those rows alone and returns them ([N, hidden], in that order):
        no later layer reads the other rows, whose k, v are in the cache by then. A prompt chunk
        that does not end its prompt samples nothing, so one layer's o_proj and MLP of every such
        row is skipped: 1 / num_layers of its linear work, the same values for the rows kept."""
        if sampled_rows is not None and not self.is_last:
            raise ValueError(f"stage [{self.start}, {self.end}) is not the last stage: its every row goes on")
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} KV caches (one per layer), got {len(kv_caches)}")
        if self.embed_tokens is not None:
            if input_ids is None:
                raise ValueError("the first stage needs input_ids")
            h = self.embed_tokens(input_ids)
        elif hidden_states is None:
            raise ValueError(f"stage [{self.start}, {self.end}) needs hidden_states")
        else:
            h = hidden_states
        cos, sin = self.rotary.lookup(positions, h.dtype)
        residual: torch.Tensor | None = None
        last = len(self.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            h, residual = layer(h, cos, sin, kv_cache, meta, residual, sampled_rows if i == last else None)
        return h.add_(residual) if residual is not None else h  # the last MLP output, fresh: added in place

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head over the rows to sample: [N, hidden] → [N, vocab] float32."""
        if self.norm is None or self.lm_head is None:
            raise RuntimeError(f"stage [{self.start}, {self.end}) is not the last stage")
        logits = self.tp.all_gather_last(self.lm_head(self.norm(hidden)))
        return logits[:, : self.config.vocab_size].float()  # vocabulary-parallel padding dropped

    def weight_names(self) -> list[str]:
        """The checkpoint (Hugging Face) tensor names this stage needs, in load order."""
        cfg = self.config
        return stage_weight_names(self.start, self.end, cfg.num_layers, cfg.tie_word_embeddings,
                                  lambda i: _layer_weight_names(i, cfg))

    @torch.no_grad()
    def load_weight(self, name: str, source: torch.Tensor | TensorSlice) -> None:
        """Copy this rank's part of one checkpoint tensor into its (possibly fused) parameter slice.

        `source` is the tensor or a lazy safetensors slice of it (`get_slice`): with tensor
        parallelism only this rank's shard is read."""
        target = self._target(name)
        if name.endswith("o_proj.bias") and self.tp.shard.rank > 0:
            target.zero_()  # a row-parallel bias is added once, after the all-reduce: by rank 0
            return
        full = tuple(source.get_shape()) if isinstance(source, TensorSlice) else tuple(source.shape)
        cut = self._shard_of(name)
        expected = list(target.shape)
        if cut.rows is not None:
            expected[0] = cut.full_rows
        if cut.cols is not None:
            expected[1] = cut.full_cols
        if tuple(expected) != full:
            raise ModelLoadError(f"tensor {name!r}: expected shape {tuple(expected)}, got {full}")
        tensor = cut.read(source)
        target[: tensor.shape[0]].copy_(tensor)
        if tensor.shape[0] < target.shape[0]:
            target[tensor.shape[0] :].zero_()  # vocabulary-parallel padding rows

    def _shard_of(self, name: str) -> _Cut:
        """Which rows / columns of checkpoint tensor `name` this rank holds (all, without TP)."""
        cfg, shard, d = self.config, self.tp.shard, self.config.head_dim
        if self.tp.size == 1:
            return _Cut()
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            vocab = shard.vocab(cfg)
            return _Cut(rows=vocab, full_rows=cfg.vocab_size)
        sub = name.split(".")[-2]
        heads, kv, mlp = shard.heads(cfg), shard.kv_heads(cfg), shard.mlp(cfg)
        q_rows, kv_rows = range(heads.start * d, heads.stop * d), range(kv.start * d, kv.stop * d)
        cuts = {"q_proj": _Cut(rows=q_rows, full_rows=cfg.num_heads * d),
                "k_proj": _Cut(rows=kv_rows, full_rows=cfg.num_kv_heads * d),
                "v_proj": _Cut(rows=kv_rows, full_rows=cfg.num_kv_heads * d),
                "gate_proj": _Cut(rows=mlp, full_rows=cfg.intermediate_size),
                "up_proj": _Cut(rows=mlp, full_rows=cfg.intermediate_size),
                "down_proj": _Cut(cols=mlp, full_cols=cfg.intermediate_size)}
        if sub == "o_proj" and name.endswith(".weight"):
            return _Cut(cols=q_rows, full_cols=cfg.num_heads * d)
        return cuts.get(sub, _Cut())

    def _target(self, name: str) -> torch.Tensor:
        if name == "model.embed_tokens.weight":
            module = self.embed_tokens if self.embed_tokens is not None else self.lm_head
            return _weight(module, name)
        if name == "model.norm.weight":
            return _weight(self.norm, name)
        if name == "lm_head.weight":
            return _weight(self.lm_head, name)
        return self._layer_target(name)

    def _layer_target(self, name: str) -> torch.Tensor:
        parts = name.split(".")
        if len(parts) < 5 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
            raise ModelLoadError(f"tensor {name!r} is not a parameter of this model")
        index = int(parts[2])
        if not self.start <= index < self.end:
            raise ModelLoadError(f"tensor {name!r} belongs to a layer outside [{self.start}, {self.end})")
        layer = self.layers[index - self.start]
        sub, kind = ".".join(parts[3:-1]), parts[-1]
        fused = _fused_slices(layer).get(sub)
        if fused is not None:
            fused_name, lo, hi = fused
            return layer.get_parameter(f"{fused_name}.{kind}")[lo:hi]
        try:
            return layer.get_parameter(f"{sub}.{kind}")
        except AttributeError as exc:
            raise ModelLoadError(f"tensor {name!r} is not a parameter of this model") from exc


@runtime_checkable
class TensorSlice(Protocol):
    """A safetensors slice (`safe_open(...).get_slice(name)`): shape known, data read on indexing."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index: Any) -> torch.Tensor: ...


@dataclass(frozen=True)
class _Cut:
    """Rows and/or columns of a checkpoint tensor (None: all), and that tensor's full extent there."""

    rows: range | None = None
    cols: range | None = None
    full_rows: int = 0
    full_cols: int = 0

    def read(self, source: torch.Tensor | TensorSlice) -> torch.Tensor:
        rows = slice(None) if self.rows is None else slice(self.rows.start, self.rows.stop)
        if self.cols is None:
            return source[rows]
        return source[rows, self.cols.start : self.cols.stop]


def _weight(module: nn.Module | None, name: str) -> torch.Tensor:
    if module is None:
        raise ModelLoadError(f"tensor {name!r} is not held by this stage")
    return module.get_parameter("weight")


def _fused_slices(layer: nn.Module) -> dict[str, tuple[str, int, int]]:
    """Checkpoint sub-module → (fused parameter's module, row slice), at this rank's sizes."""
    attn, mlp = layer.get_submodule("self_attn"), layer.get_submodule("mlp")
    if not isinstance(attn, Attention) or not isinstance(mlp, MLP):
        raise ModelLoadError(f"layer {layer!r} is not a decoder layer")
    q, kv, inter = attn.q_size, attn.kv_size, mlp.intermediate_size
    return {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0, q),
        "self_attn.k_proj": ("self_attn.qkv_proj", q, q + kv),
        "self_attn.v_proj": ("self_attn.qkv_proj", q + kv, q + 2 * kv),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0, inter),
        "mlp.up_proj": ("mlp.gate_up_proj", inter, 2 * inter),
    }


def _layer_weight_names(i: int, config: ModelConfig) -> list[str]:
    p = layer_prefix(i)
    names = [p + f"self_attn.{n}_proj.weight" for n in ("q", "k", "v", "o")]
    if config.qkv_bias:
        names += [p + f"self_attn.{n}_proj.bias" for n in ("q", "k", "v")]
        if config.architecture != "Qwen2ForCausalLM":
            names.append(p + "self_attn.o_proj.bias")
    names += [p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
    names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    return names


def allocate_kv_caches(
    config: ModelConfig,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    shard: Shard = NO_SHARD,
) -> list[KVCache]:
    """One (k_cache, v_cache) pair per layer, each [num_blocks, block_size, kv_heads, head_dim]
    (`chariot.kernels.empty_kv_cache`: head-major in memory on the CPU); kv_heads are the ones
    tensor-parallel rank `shard` stores.

    Left uninitialised: the attention contract (`chariot.kernels`) never reads a slot at or past a
    sequence's length (the kernel tests run on NaN-filled caches), and zero-filling a cache sized
    from free memory would cost seconds at start-up and commit all of its memory at once. A page is
    committed (one page fault) the first time a block on it is written; the block manager hands out
    the most recently freed blocks first, so without prefix caching that happens only as far as the
    peak usage reaches.
    """
    def one() -> torch.Tensor:
        kv_heads = len(shard.kv_heads(config))
        return empty_kv_cache(num_blocks, block_size, kv_heads, config.head_dim, dtype, device)

    return [(one(), one()) for _ in range(num_layers)]
