"""Every router setting is a `RouterConfig` field: `chariot router`'s flags become one config, validated
once, and `run_router` takes that config plus its runtime hooks only."""

from __future__ import annotations

import argparse
import inspect

import pytest

from chariot.contracts.errors import ConfigError
from chariot.router.app import add_router_parser, config_from_args, run_router
from chariot.router.config import RouterConfig


def parse(*argv: str) -> RouterConfig:
    parser = argparse.ArgumentParser()
    add_router_parser(parser.add_subparsers(dest="command"))
    return config_from_args(parser.parse_args(["router", *argv]))


def test_run_router_takes_the_config_and_runtime_hooks_only() -> None:
    assert list(inspect.signature(run_router).parameters) == ["config", "ready", "stop"]


def test_flags_become_one_config() -> None:
    config = parse("--host", "0.0.0.0", "--http-port", "0", "--grpc-port", "9", "--replica", "g0=h:1",
                   "--replica", "h:2", "--model", "models/tiny", "--otlp-endpoint", "http://c:4317",
                   "--ttft-slo-ms", "500")
    assert (config.host, config.http_port, config.grpc_port) == ("0.0.0.0", 0, 9)
    assert config.replicas == ("g0=h:1", "h:2")
    assert (config.served_model, config.model_dir) == ("tiny", "models/tiny")  # the directory's name
    assert (config.otlp_endpoint, config.ttft_slo_ms) == ("http://c:4317", 500.0)


def test_flag_defaults_are_the_config_defaults() -> None:
    config, default = parse(), RouterConfig()
    for name in ("host", "http_port", "grpc_port", "replicas", "served_model", "model_dir", "otlp_endpoint",
                 "stats_interval_s", "grace_s", "ttft_slo_ms", "tbt_slo_ms", "max_queue_per_replica"):
        assert getattr(config, name) == getattr(default, name), name


@pytest.mark.parametrize(("field", "value"), [
    ("http_port", 70000), ("grpc_port", -1), ("http_port", True), ("host", ""), ("served_model", ""),
    ("replicas", "g0=h:1"), ("replicas", ("",)), ("stats_interval_s", 0.0), ("grace_s", -1.0),
])
def test_bad_process_settings_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as err:
        RouterConfig(**{field: value})  # type: ignore[arg-type]
    assert err.value.field == field


def test_replicas_are_kept_as_a_tuple() -> None:
    assert RouterConfig(replicas=["g0=h:1"]).replicas == ("g0=h:1",)  # type: ignore[arg-type]
