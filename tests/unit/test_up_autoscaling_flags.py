"""`chariot up --max-replicas`: the flags become the operator's `AutoscalingPolicy`, a bad value is a
`ConfigError` naming the flag, and the replica file the router watches has the registry's format."""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import pytest

from chariot.cli import up
from chariot.cli.autoscale import write_replica_file
from chariot.cli.groups import LocalGroup, bound_grpc_port
from chariot.contracts.errors import ConfigError
from chariot.contracts.processes import Child
from chariot.router.registry import parse_replica_file


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    up.register(sub)
    return parser.parse_args(["up", *argv])


def test_flags_make_the_policy() -> None:
    assert up.autoscaling_policy(parse()) is None
    policy = up.autoscaling_policy(parse("--max-replicas", "3", "--min-replicas", "2", "--target-utilization", "0.5",
                                         "--scale-down-stabilization-seconds", "10", "--drain-grace-seconds", "5"))
    assert policy is not None
    assert (policy.min_replicas, policy.max_replicas, policy.target_utilization, policy.scale_up_stabilization_s,
            policy.scale_down_stabilization_s, policy.drain_grace_s) == (2, 3, 0.5, 0.0, 10.0, 5.0)
    assert policy.bound(1) == 2


@pytest.mark.parametrize(("argv", "field"), [
    (("--max-replicas", "1", "--min-replicas", "2"), "max_replicas"),
    (("--max-replicas", "2", "--target-utilization", "2"), "target_utilization"),
    (("--max-replicas", "2", "--min-replicas", "0"), "min_replicas"),
    (("--max-replicas", "2", "--scale-down-stabilization-seconds", "-1"), "scale_down_stabilization_seconds"),
])
def test_bad_flags_name_the_flag(argv: tuple[str, ...], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        up.autoscaling_policy(parse(*argv))
    assert err.value.field == field


def test_the_replica_file_is_what_the_router_reads(tmp_path: Path) -> None:
    path = tmp_path / "replicas.json"
    groups = [LocalGroup(1, 5001, [], 0.0), LocalGroup(0, 5000, [], 0.0)]
    write_replica_file(path, groups)
    assert [(r.name, r.address) for r in parse_replica_file(path.read_text())] == \
        [("g0", "127.0.0.1:5000"), ("g1", "127.0.0.1:5001")]


def test_a_group_is_listed_once_its_stage0_names_the_port_it_bound(tmp_path: Path) -> None:
    """Stage 0 binds port 0 and names the port in its ready line: until then the group is left out
    of the replica file, since no address is known yet. (A real process stands in for stage 0;
    only its ready line matters here.)"""
    path = tmp_path / "replicas.json"
    proc = subprocess.Popen(["true"], text=True)
    proc.wait()
    stage0 = Child("replica 1 stage 0", proc)
    starting = LocalGroup(1, 0, [stage0], 0.0)
    write_replica_file(path, [LocalGroup(0, 5000, [], 0.0), starting])
    assert [r.name for r in parse_replica_file(path.read_text())] == ["g0"]
    assert not starting.learn_port()
    stage0.ready_line = "chariot worker ready grpc=127.0.0.1:41234 metrics=127.0.0.1:41235"
    assert starting.learn_port() and starting.address == "127.0.0.1:41234"
    assert not starting.learn_port()  # learned once; a restart keeps it
    write_replica_file(path, [LocalGroup(0, 5000, [], 0.0), starting])
    assert [r.address for r in parse_replica_file(path.read_text())] == ["127.0.0.1:5000", "127.0.0.1:41234"]


def test_a_ready_line_without_a_port_is_an_error() -> None:
    assert bound_grpc_port("chariot worker ready grpc=[::1]:50051 metrics=x:1") == 50051
    with pytest.raises(RuntimeError, match="names no gRPC port"):
        bound_grpc_port("chariot worker ready metrics=127.0.0.1:9")
