"""How many aten operations a decoder layer dispatches in a one-sequence decode step, held to a bound.

On a GPU every aten operation that does work is at least one kernel launch, and each launch costs the
host microseconds; a decode step of a small model is bound by them (docs/kernels.md, "Kernels per
layer"). This test counts the operations with a `TorchDispatchMode` over one decode step of the
`small` preset (4 layers, hidden 256) through `LlamaStage`, layer by layer (forward hooks mark where
each layer starts and ends), and fails when a change adds operations: the bounds are what the code
reaches now. A change that removes operations should lower them.

The stage's linear layers stay plain `nn.Linear` (`cpu_linears=False`): the CPU linear routing
chooses its kernel by timing at start-up, which must not move the count.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from chariot.kernels import AttentionMetadata
from chariot.worker.model.llama import LlamaStage, allocate_kv_caches
from chariot.worker.model.loader import load_stage

# Operations per decoder layer, and per whole stage forward (embedding, layers, stage output), in a
# one-sequence decode step on the CPU. Raise them only with a reason written in docs/kernels.md.
MAX_OPS_PER_LAYER = 19
MAX_OPS_PER_FORWARD = 80
CONTEXT, BLOCK_SIZE = 9, 8  # decode the 10th token: its slot is in the second block


class OpCounter(TorchDispatchMode):
    """Counts the aten operations dispatched while it is active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def one_sequence_meta(table: list[int], start: int, num_tokens: int, device: str = "cpu") -> AttentionMetadata:
    """Metadata for one sequence computing tokens [start, start + num_tokens)."""
    pos = torch.arange(start, start + num_tokens, device=device)
    blocks = torch.tensor(table, dtype=torch.int32, device=device)
    return AttentionMetadata(
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([start + num_tokens], dtype=torch.int32, device=device),
        block_tables=blocks.view(1, -1),
        slot_mapping=blocks[pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE,
        query_lens=(num_tokens,),
        seq_lens_list=(start + num_tokens,),
        num_decodes=1 if num_tokens == 1 else 0,
    )


@contextmanager
def per_layer(layers: nn.ModuleList, counter: OpCounter) -> Iterator[list[list[str]]]:
    """The operations each layer's forward dispatched (one list per call), recorded by hooks."""
    spans: list[list[str]] = []
    starts: list[int] = []

    def enter(_module: nn.Module, _args: Any) -> None:
        starts.append(len(counter.names))

    def leave(_module: nn.Module, _args: Any, _out: Any) -> None:
        spans.append(counter.names[starts.pop() :])

    handles = [hook for layer in layers
               for hook in (layer.register_forward_pre_hook(enter), layer.register_forward_hook(leave))]
    try:
        yield spans
    finally:
        for handle in handles:
            handle.remove()


def prefilled(stage: LlamaStage, device: str = "cpu") -> tuple[list[tuple[torch.Tensor, torch.Tensor]], Any]:
    """The stage's caches after a short prompt, and a function running one decode step over them."""
    dtype = next(stage.parameters()).dtype
    caches = allocate_kv_caches(stage.config, len(stage.layers), 4, BLOCK_SIZE, dtype, device)
    ids = torch.arange(3, 3 + CONTEXT + 1, device=device)
    with torch.inference_mode():
        prompt = one_sequence_meta([2, 0], 0, CONTEXT, device)
        stage(torch.arange(CONTEXT, device=device), caches, prompt, input_ids=ids[:CONTEXT])
    meta = one_sequence_meta([2, 0], CONTEXT, 1, device)
    positions, token = torch.tensor([CONTEXT], device=device), ids[CONTEXT:]

    def decode() -> torch.Tensor:
        with torch.inference_mode():
            return stage(positions, caches, meta, input_ids=token)

    return caches, decode


def decode_step_ops(stage: LlamaStage) -> tuple[list[str], list[list[str]]]:
    """(the whole forward's operations, each layer's) for one decode token after a short prefill."""
    _, decode = prefilled(stage)
    with OpCounter() as counter, per_layer(stage.layers, counter) as spans:
        decode()
    return counter.names, spans


def test_decode_step_ops_per_layer_hold_the_line(small_model_dir: Path) -> None:
    stage = load_stage(small_model_dir, (0, 4), torch.float32, progress=False, cpu_linears=False)
    total, layers = decode_step_ops(stage)
    counts = [len(ops) for ops in layers]
    print(f"aten ops per decoder layer: {counts}; whole stage forward: {len(total)}")
    print("one layer:", ", ".join(layers[-1]))
    assert len(counts) == 4, "every layer's forward was counted once"
    assert max(counts) <= MAX_OPS_PER_LAYER, f"a decoder layer dispatches {max(counts)} aten ops > {MAX_OPS_PER_LAYER}"
    assert len(total) <= MAX_OPS_PER_FORWARD, f"the stage forward dispatches {len(total)} > {MAX_OPS_PER_FORWARD}"
    assert sum(counts) < len(total), "the layers are counted inside the forward"


# --- on CUDA: kernels launched per layer ---------------------------------------------------------

MAX_KERNELS_PER_LAYER = 12  # issue 38's target for an eager decode iteration; docs/kernels.md has the count


def cuda_kernels(decode: Any) -> Counter[str]:
    """The CUDA kernels one (already warmed-up) decode step runs, by name, from the profiler (copies
    and fills are not kernels the layer launches)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        decode()
        torch.cuda.synchronize()
    return Counter(e.name for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset")))


def kernels_per_layer(model_dir: Path, fused: bool, monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """The kernels of a 4-layer step less those of a 2-layer step, halved: one layer's, by name (the
    stage's own kernels cancel). Attention is the engine's on CUDA, the Triton backend."""
    from chariot.kernels import layer_ops

    monkeypatch.undo()  # the real dispatch, whatever an earlier call patched in
    if not fused:
        monkeypatch.setattr(layer_ops, "fused_on", lambda _tensor: False)
    counts = []
    for layers in (2, 4):
        stage = load_stage(model_dir, (0, layers), torch.bfloat16, device="cuda", progress=False)
        _, decode = prefilled(stage, "cuda")
        decode()  # compiles the Triton kernels
        counts.append(cuda_kernels(decode))
    return Counter({name: (counts[1][name] - counts[0][name]) // 2 for name in counts[1]
                    if counts[1][name] > counts[0][name]})


@pytest.mark.gpu
def test_cuda_decode_kernels_per_layer(small_model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                       triton_backend: None) -> None:
    eager = kernels_per_layer(small_model_dir, False, monkeypatch)
    fused = kernels_per_layer(small_model_dir, True, monkeypatch)
    total_eager, total_fused = sum(eager.values()), sum(fused.values())
    print(f"CUDA kernels per decoder layer, one-sequence bf16 decode: eager PyTorch ops {total_eager}, "
          f"fused {total_fused}: {dict(fused)}")
    assert total_fused <= MAX_KERNELS_PER_LAYER, f"{total_fused} kernels a layer: {dict(fused)}"
    assert total_fused < total_eager


@pytest.mark.gpu
def test_cuda_fused_layers_match_eager_pytorch(small_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode step's logits with the fused kernels equal eager PyTorch's (float32, one token)."""
    from chariot.kernels import layer_ops

    fused_on = layer_ops.fused_on
    logits = []
    for fused in (False, True):
        monkeypatch.setattr(layer_ops, "fused_on", fused_on if fused else lambda _tensor: False)
        stage = load_stage(small_model_dir, (0, 4), torch.float32, device="cuda", progress=False)
        _, decode = prefilled(stage, "cuda")
        with torch.inference_mode():
            logits.append(stage.compute_logits(decode()).cpu())
    torch.testing.assert_close(logits[1], logits[0], atol=1e-3 * float(logits[0].abs().max()), rtol=0)
