"""One GPU per rank: the local launchers give rank r `LOCAL_RANK=r`, a rank on CUDA takes
`cuda:$LOCAL_RANK`, and a group that needs more GPUs than the machine has is refused before any
process starts, naming the field (NCCL cannot put two ranks of one group on one GPU; seen on an H100
as "Duplicate GPU detected").

No GPU here: `torch.cuda.device_count` is replaced where a rank's device is resolved. The real check
on CUDA is `tests/integration/test_triton_engine.py::test_cuda_pipeline_stages_take_one_gpu_each`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from chariot.contracts.errors import ConfigError
from chariot.contracts.processes import Topology
from chariot.worker.config import EngineConfig, ResolvedConfig
from chariot.worker.pipeline.launcher import check_local_devices, rank_env
from chariot.worker.pipeline.tensor import RankPlace
from chariot.worker.runtime import _rank_device


def config(device: str, stages: int = 2, tensor: int = 1) -> EngineConfig:
    return EngineConfig(model="unused", device=device, pipeline_stages=stages, tensor_parallel_size=tensor)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_single_rank_needs_no_check(device: str) -> None:
    check_local_devices(config(device, stages=1), visible=0)


def test_cpu_groups_are_not_checked() -> None:
    check_local_devices(config("cpu", stages=4, tensor=2), visible=0)


@pytest.mark.parametrize(("stages", "tensor", "visible"), [(2, 1, 2), (2, 2, 4), (1, 2, 8)])
def test_enough_gpus_pass(stages: int, tensor: int, visible: int) -> None:
    check_local_devices(config("cuda", stages, tensor), visible=visible)


def test_too_few_gpus_name_the_field_and_both_numbers() -> None:
    with pytest.raises(ConfigError) as err:
        check_local_devices(config("cuda", stages=2, tensor=2), visible=3)
    assert err.value.field == "pipeline_stages"
    assert "= 4 ranks need 4 GPUs" in err.value.message and "3 are visible" in err.value.message


def test_one_named_gpu_for_a_group_is_refused() -> None:
    with pytest.raises(ConfigError) as err:
        check_local_devices(config("cuda:1", stages=2), visible=8)
    assert err.value.field == "device" and "'cuda:1' puts all" in err.value.message


def test_rank_env_gives_every_rank_its_local_device() -> None:
    topo = Topology(0, 3, "127.0.0.1", 29500)
    assert [rank_env(config("cuda", stages=3), topo, r)["LOCAL_RANK"] for r in range(3)] == ["0", "1", "2"]


@pytest.fixture
def cuda_resolved(tiny_model_dir: Path) -> ResolvedConfig:
    """A resolved config whose device says CUDA (resolution itself runs on the CPU)."""
    resolved = ResolvedConfig.resolve(EngineConfig(model=str(tiny_model_dir), dtype="float32"))
    return dataclasses.replace(resolved, device=torch.device("cuda"))


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_rank_takes_cuda_local_rank(cuda_resolved: ResolvedConfig, two_gpus: None,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert _rank_device(cuda_resolved, RankPlace.of(1, 1)).device == torch.device("cuda", 1)


def test_single_gpu_stage_without_local_rank_keeps_cuda(cuda_resolved: ResolvedConfig, two_gpus: None,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert _rank_device(cuda_resolved, RankPlace.of(0, 1)).device == torch.device("cuda")


def test_tensor_shard_without_local_rank_takes_its_shard(cuda_resolved: ResolvedConfig, two_gpus: None,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert _rank_device(cuda_resolved, RankPlace.of(3, 2)).device == torch.device("cuda", 1)


def test_missing_gpu_is_named(cuda_resolved: ResolvedConfig, two_gpus: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(ConfigError) as err:
        _rank_device(cuda_resolved, RankPlace.of(2, 1))
    assert err.value.field == "device"
    assert "needs cuda:2" in err.value.message and "2 CUDA device(s)" in err.value.message


def test_named_gpu_is_kept(cuda_resolved: ResolvedConfig, two_gpus: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    named = dataclasses.replace(cuda_resolved, device=torch.device("cuda", 0))
    assert _rank_device(named, RankPlace.of(1, 1)).device == torch.device("cuda", 0)
