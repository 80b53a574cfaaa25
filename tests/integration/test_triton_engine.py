"""The engine on the Triton attention backend generates exactly what it does on the reference one.

The executor never names a backend (`chariot.kernels` dispatches), so switching the backend must not
change a single greedy token: a mixed batch with small token budgets puts prefill chunks inside and
across KV blocks next to decodes, and forced preemption re-prefills evicted sequences.
On CPU the Triton kernels run under the interpreter (`TRITON_INTERPRET=1`, set by tests/conftest.py
before anything imports triton); on a GPU machine the `gpu` variant runs them compiled on CUDA
against the CPU reference path.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import chariot.kernels as kernels
from chariot.contracts.errors import ConfigError
from chariot.contracts.sampling_params import SamplingParams
from chariot.worker.llm import LLM

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[7], list(range(3, 40)), list(range(50, 67)), [9, 8, 7, 6, 5]]  # single-token, >2 blocks, 1 block + 1


@pytest.fixture
def backend_restored() -> Iterator[None]:
    """The process's own choice of backend back after the test (a test that left one selected
    would change what every later test in the session runs)."""
    yield
    kernels.select_backend()


def run(model_dir: Path, backend: str, device: str, prompts: list[list[int]] = PROMPTS,
        params: SamplingParams = GREEDY, **engine: object) -> tuple[list[list[int]], LLM]:
    """Greedy tokens of `prompts` (and the LLM, for its scheduler's counters) on `backend`."""
    kernels.select_backend(backend)
    config: dict[str, object] = {"dtype": "float32", "max_model_len": 128, "kv_cache_tokens": 1024,
                                 "block_size": 16, **engine}  # a GPU engine's block size, as Triton serves GPUs
    llm = LLM(str(model_dir), progress=False, device=device, **config)  # type: ignore[arg-type]
    return [out.token_ids for out in llm.generate(prompts, params)], llm


def greedy_tokens(model_dir: Path, backend: str, device: str, **engine: object) -> list[list[int]]:
    return run(model_dir, backend, device, **engine)[0]


@pytest.mark.parametrize("budget", [8, 24])
def test_greedy_tokens_identical_to_reference_backend(tiny_model_dir: Path, backend_restored: None,
                                                      budget: int) -> None:
    expected = greedy_tokens(tiny_model_dir, "reference", "cpu", token_budget=budget)
    got = greedy_tokens(tiny_model_dir, "triton", "cpu", token_budget=budget)
    assert kernels.get_backend() == "triton"
    assert got == expected


def test_greedy_tokens_identical_after_preemption(tiny_model_dir: Path, backend_restored: None) -> None:
    # Six sequences growing to 34–54 tokens need 18 blocks of 16; 9 force evictions and recomputation.
    prompts = [list(range(10, 10 + n)) for n in (10, 12, 14, 15, 20, 30)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    small: dict[str, object] = {"token_budget": 16, "kv_cache_tokens": 9 * 16}
    expected, _ = run(tiny_model_dir, "reference", "cpu", prompts, params, **small)
    got, llm = run(tiny_model_dir, "triton", "cpu", prompts, params, **small)
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == expected


@pytest.mark.gpu
@pytest.mark.parametrize("budget", [8, 64])
def test_cuda_triton_matches_cpu_reference(small_model_dir: Path, backend_restored: None, budget: int) -> None:
    expected = greedy_tokens(small_model_dir, "reference", "cpu", token_budget=budget)
    got = greedy_tokens(small_model_dir, "triton", "cuda", token_budget=budget)
    assert torch.cuda.is_available() and got == expected


@pytest.mark.gpu
def test_cuda_pipeline_stages_take_one_gpu_each(small_model_dir: Path, backend_restored: None) -> None:
    """On one machine each stage of a CUDA group gets its own GPU (NCCL refuses two ranks on one): with
    fewer GPUs than stages the group is refused before any stage process starts, naming the field."""
    if torch.cuda.device_count() < 2:
        with pytest.raises(ConfigError, match=r"pipeline_stages: 2 stage\(s\) .* need 2 GPUs"):
            run(small_model_dir, "triton", "cuda", pipeline_stages=2)
        return
    expected = greedy_tokens(small_model_dir, "reference", "cpu")
    assert greedy_tokens(small_model_dir, "triton", "cuda", pipeline_stages=2) == expected
