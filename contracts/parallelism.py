"""The one rule of how a model splits over tensor-parallel ranks, shared by the worker (which shards
the model) and the operator (which rejects a `ModelDeployment` it can already see will not split).
Torch-free."""

from __future__ import annotations


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
