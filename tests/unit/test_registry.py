"""The replica registry: parsing, the watched replica file, readiness from load reports, accounting."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from chariot.contracts.errors import ConfigError
from chariot.proto.chariot.v1 import generation_pb2 as pb
from chariot.router.config import RouterConfig
from chariot.router.registry import (
    RegistryChange,
    ReplicaLoad,
    ReplicaRegistry,
    ReplicaSpec,
    parse_replica_file,
    parse_replica_flags,
)


class FakeClock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def write_replicas(path: Path, replicas: list[dict[str, Any]] | str) -> None:
    """Replace the file atomically, as the kubelet does with a ConfigMap (new inode)."""
    text = replicas if isinstance(replicas, str) else json.dumps({"replicas": replicas})
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def load(at: float, **fields: Any) -> ReplicaLoad:
    return ReplicaLoad(token_budget=512, prefill_tokens_per_s=1000.0, reported_at=at, **fields)


# --- parsing -------------------------------------------------------------------------------------------


def test_flags_take_name_equals_address_or_a_bare_address() -> None:
    specs = parse_replica_flags(["g0=10.0.0.1:50051", "worker-1.svc:6000", "v6=[::1]:7000"])
    assert specs == [
        ReplicaSpec("g0", "10.0.0.1:50051"),
        ReplicaSpec("worker-1.svc:6000", "worker-1.svc:6000"),
        ReplicaSpec("v6", "[::1]:7000"),
    ]


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (["g0=10.0.0.1"], "replicas[0].address"),
        (["g0=:50051"], "replicas[0].address"),
        (["ok=h:1", "bad=h:99999"], "replicas[1].address"),
        (["=h:1"], "replicas[0].name"),
        (["a=h:1", "a=h:2"], "replicas"),
    ],
)
def test_bad_flags_name_the_field(flags: list[str], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_replica_flags(flags)
    assert info.value.field == field


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("not json", "replicas"),
        ('{"replicas": {}}', "replicas"),
        ("[]", "replicas"),
        ('{"replicas": ["h:1"]}', "replicas[0]"),
        ('{"replicas": [{"name": "a"}]}', "replicas[0].address"),
        ('{"replicas": [{"address": "h:1"}]}', "replicas[0].name"),
    ],
)
def test_bad_files_name_the_field(text: str, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_replica_file(text)
    assert info.value.field == field


def test_from_config_reads_the_file_or_the_flags(tmp_path: Path) -> None:
    path = tmp_path / "replicas.json"
    write_replicas(path, [{"name": "g0", "address": "g0:50051"}])
    from_file = ReplicaRegistry.from_config(RouterConfig(replica_file=str(path)), flags=["x=h:1"])
    assert from_file.specs() == [ReplicaSpec("g0", "g0:50051")]
    assert ReplicaRegistry.from_config(RouterConfig(), flags=["x=h:1"]).names() == ["x"]


def test_an_invalid_file_at_start_up_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "replicas.json"
    with pytest.raises(ConfigError) as info:
        ReplicaRegistry(path=path)
    assert info.value.field == "replica_file"
    write_replicas(path, "{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ReplicaRegistry(path=path)


# --- the watched file ------------------------------------------------------------------------------------


def test_file_changes_are_applied_and_announced(tmp_path: Path) -> None:
    path = tmp_path / "replicas.json"
    write_replicas(path, [{"name": "g0", "address": "g0:1"}, {"name": "g1", "address": "g1:1"}])
    clock = FakeClock()
    registry = ReplicaRegistry(path=path, clock=clock)
    changes: list[RegistryChange] = []
    registry.subscribe(changes.append)
    registry.update_load("g0", load(clock.t))
    registry.update_load("g1", load(clock.t))
    assert not registry.reload_if_changed()  # unchanged file: nothing to do

    write_replicas(
        path, [{"name": "g0", "address": "g0:1"}, {"name": "g1", "address": "g1:2"}, {"name": "g2", "address": "g2:1"}]
    )
    assert registry.reload_if_changed()
    assert changes == [RegistryChange(added=("g2",), removed=(), changed=("g1",))]
    assert registry.address("g1") == "g1:2"
    assert [v.name for v in registry.ready()] == ["g0"]  # g0 kept its report; g1 moved, so its report is void

    write_replicas(path, [{"name": "g2", "address": "g2:1"}])
    assert registry.reload_if_changed()
    assert changes[-1] == RegistryChange(removed=("g0", "g1"))
    assert registry.names() == ["g2"]
    assert not registry.update_load("g0", load(clock.t))  # reports of removed replicas are dropped


def test_an_invalid_file_keeps_the_previous_set_and_logs_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "replicas.json"
    write_replicas(path, [{"name": "g0", "address": "g0:1"}])
    registry = ReplicaRegistry(path=path)
    caplog.set_level(logging.ERROR, logger="chariot.router.registry")

    write_replicas(path, '{"replicas": [{"name": "g0", "address": "no-port"}]}')
    assert not registry.reload_if_changed()
    assert not registry.reload_if_changed()
    assert registry.specs() == [ReplicaSpec("g0", "g0:1")]
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "replicas[0].address" in errors[0].getMessage()

    path.unlink()  # a missing file (mid-update) keeps the set too
    assert not registry.reload_if_changed()
    assert registry.names() == ["g0"]

    write_replicas(path, [{"name": "g1", "address": "g1:1"}])
    assert registry.reload_if_changed()
    assert registry.names() == ["g1"]


def test_the_watch_task_polls_the_file(tmp_path: Path) -> None:
    path = tmp_path / "replicas.json"
    write_replicas(path, [{"name": "g0", "address": "g0:1"}])
    registry = ReplicaRegistry(path=path)

    async def scenario() -> None:
        task = registry.start_watching(0.01)
        write_replicas(path, [{"name": "g5", "address": "g5:1"}])
        for _ in range(200):
            if registry.names() == ["g5"]:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
    assert registry.names() == ["g5"]


# --- readiness ------------------------------------------------------------------------------------------


def test_readiness_needs_a_fresh_usable_report() -> None:
    clock = FakeClock()
    registry = ReplicaRegistry([ReplicaSpec("a", "a:1"), ReplicaSpec("b", "b:1")], staleness_s=5.0, clock=clock)
    assert registry.ready() == []  # never reported
    registry.update_load("a", load(clock.t))
    registry.update_load("b", ReplicaLoad(reported_at=clock.t))  # no budget, no rate: cannot predict
    assert [v.name for v in registry.ready()] == ["a"]
    clock.t += 5.0
    assert [v.name for v in registry.ready()] == ["a"]
    clock.t += 0.1
    assert registry.ready() == []  # stale
    registry.update_load("a", load(clock.t))
    registry.clear_load("a")  # its Stats call failed
    assert registry.ready() == []


def test_load_from_a_stats_response() -> None:
    stats = pb.StatsResponse(
        num_waiting=3,
        num_running=7,
        queued_prefill_tokens=1234,
        kv_cache_usage=0.5,
        token_budget=512,
        max_batch_size=64,
        max_model_len=4096,
        last_iteration_s=0.04,
        prefill_tokens_per_s=9000.0,
        budget_tokens_per_s=12000.0,
        pipeline_stages=2,
    )
    got = ReplicaLoad.from_stats(stats, reported_at=12.5)
    assert got == ReplicaLoad(3, 7, 1234, 0.5, 512, 64, 4096, 0.04, 9000.0, 12000.0, 2, 12.5)
    assert ReplicaLoad.from_stats(pb.StatsResponse(), 0.0).pipeline_stages == 1


def test_own_accounting_per_replica() -> None:
    registry = ReplicaRegistry([ReplicaSpec("a", "a:1")])
    registry.note_admitted("a", 100)
    registry.note_admitted("a", 50)
    registry.note_first_token("a", 100)
    registry.note_finished("a", 0)
    registry.note_admitted("gone", 5)  # unknown replica: ignored
    view = registry.snapshot()[0]
    assert (view.in_flight, view.unprefilled_tokens) == (1, 50)
    registry.note_finished("a", 50)
    view = registry.snapshot()[0]
    assert (view.in_flight, view.unprefilled_tokens) == (0, 0)
