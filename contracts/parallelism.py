"""The rules of how a model splits over pipeline stages and tensor-parallel ranks, shared by the worker
(which loads and shards the model), the model fetch (which downloads only the checkpoint files a
stage loads) and the operator (which rejects a `ModelDeployment` it can already see will not split).
Torch-free."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from chariot.contracts.errors import ConfigError

# Hugging Face tensor names outside the decoder layers.
EMBEDDINGS = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"


def tensor_split_problem(tensor: int, heads: int, kv_heads: int, intermediate: int) -> str | None:
    """Why `tensor` ranks cannot share a model of that shape (None when they can): every rank needs
    whole attention heads and an equal share of the MLP; KV heads are split, or replicated when there
    are fewer of them than ranks (then the ranks must be a multiple of them)."""
    if tensor < 1:
        return f"must be at least 1, got {tensor}"
    if heads % tensor:
        return f"must divide the attention heads ({heads}), got {tensor}"
    if kv_heads % tensor and tensor % kv_heads:
        return f"must divide the KV heads ({kv_heads}) or be a multiple of them, got {tensor}"
    if intermediate % tensor:
        return f"must divide the MLP width (intermediate_size {intermediate}), got {tensor}"
    return None


def split_layers(num_layers: int, num_stages: int, override: list[int] | None = None) -> list[tuple[int, int]]:
    """Layer ranges per pipeline stage: an even split (earlier stages take the remainder), or the
    explicit per-stage layer counts in `override`."""
    if num_stages < 1 or num_stages > num_layers:
        raise ConfigError("pipeline_stages", f"must be in [1, {num_layers}] (the number of layers), got {num_stages}")
    if override is None:
        base, rem = divmod(num_layers, num_stages)
        counts = [base + (1 if i < rem else 0) for i in range(num_stages)]
    else:
        counts = _check_override(num_layers, num_stages, override)
    ranges, start = [], 0
    for count in counts:
        ranges.append((start, start + count))
        start += count
    return ranges


def _check_override(num_layers: int, num_stages: int, override: list[int]) -> list[int]:
    if len(override) != num_stages:
        raise ConfigError("layer_split", f"needs one layer count per stage ({num_stages}), got {len(override)}")
    if any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in override):
        raise ConfigError("layer_split", f"every stage needs at least 1 layer, got {override}")
    if sum(override) != num_layers:
        raise ConfigError("layer_split", f"counts must sum to num_layers ({num_layers}), got {sum(override)}")
    return list(override)


def layer_prefix(layer: int) -> str:
    """The name prefix of decoder layer `layer`'s tensors in a Hugging Face checkpoint."""
    return f"model.layers.{layer}."


def stage_weight_names(start: int, end: int, num_layers: int, tied: bool,
                       layer_names: Callable[[int], Iterable[str]]) -> list[str]:
    """The checkpoint tensors the pipeline stage holding layers [start, end) of `num_layers` loads, in
    load order: the embeddings on the first stage, `layer_names(i)` of each of its layers, and on the
    last stage the final norm and the LM head — which, where the checkpoint ties it to the embeddings
    (`tied`), is the embeddings tensor (loaded once when the stage is also the first)."""
    first, last = start == 0, end == num_layers
    names = [EMBEDDINGS] if first else []
    for i in range(start, end):
        names += layer_names(i)
    if last:
        names.append(FINAL_NORM)
        if not tied:
            names.append(LM_HEAD)
        elif not first:
            names.append(EMBEDDINGS)
    return names
