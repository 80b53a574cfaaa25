"""One source per engine setting: the worker's flags, `LLM`'s keywords, `EngineConfig`, the CRD (Python
and the chart's YAML) and the operator's spec all agree with `chariot.contracts.engine_settings`.

Each test reads the real artefact — the argparse parser, `inspect.signature(LLM)`, the rendered CRD
schema and the chart's file, the spec dataclasses — so a default written anywhere else fails here.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
from pathlib import Path
from typing import Any

import pytest
import yaml

from chariot.contracts import engine_settings as settings
from chariot.contracts.engine_settings import ENGINE_CORE, ENGINE_SETTINGS, CrdField, Setting
from chariot.contracts.errors import ConfigError
from chariot.operator import crd, render
from chariot.operator import spec as operator_spec
from chariot.operator.spec import parse_spec
from chariot.worker.config import EngineConfig
from chariot.worker.flags import add_engine_flags, config_from_args, config_to_argv
from chariot.worker.llm import LLM

ROOT = Path(__file__).resolve().parents[2]
CRD_EXPOSED = [s for s in ENGINE_SETTINGS if s.crd is not None]
# Where the operator's parsed spec keeps each CRD-exposed engine setting (its dataclass and field).
SPEC_FIELDS: dict[str, tuple[type, str, str]] = {
    "policy": (operator_spec.SchedulerSpec, "scheduler", "policy"),
    "token_budget": (operator_spec.SchedulerSpec, "scheduler", "token_budget"),
    "max_batch_size": (operator_spec.SchedulerSpec, "scheduler", "max_batch_size"),
    "block_size": (operator_spec.SchedulerSpec, "scheduler", "block_size"),
    "prefill_order": (operator_spec.SchedulerSpec, "scheduler", "prefill_order"),
    "dtype": (operator_spec.ModelSpec, "model", "dtype"),
    "max_model_len": (operator_spec.ModelSpec, "model", "max_model_len"),
    "pipeline_stages": (operator_spec.Spec, "", "pipeline"),
    "tensor_parallel_size": (operator_spec.Spec, "", "tensor"),
    "rendezvous_timeout_s": (operator_spec.Spec, "", "rendezvous_timeout_s"),
}


def worker_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    return p


def by_name(values: list[Setting[Any]]) -> list[Any]:
    return [pytest.param(s, id=s.name) for s in values]


def schema_node(schema: dict[str, Any], path: str) -> dict[str, Any]:
    node = schema
    for part in path.split("."):
        node = node["properties"][part]
    return node


def chart_spec_schema() -> dict[str, Any]:
    manifest = yaml.safe_load((ROOT / crd.CHART_CRD_PATH).read_text())
    (version,) = manifest["spec"]["versions"]
    return dict(version["schema"]["openAPIV3Schema"]["properties"]["spec"])


def test_every_engine_config_field_is_declared_in_order() -> None:
    fields = [f.name for f in dataclasses.fields(EngineConfig)]
    assert fields == ["model", *(s.name for s in ENGINE_SETTINGS)]


@pytest.mark.parametrize("setting", by_name(list(ENGINE_SETTINGS)))
def test_engine_config_default_is_the_declared_one(setting: Setting[Any]) -> None:
    (field,) = [f for f in dataclasses.fields(EngineConfig) if f.name == setting.name]
    assert field.default == setting.default


@pytest.mark.parametrize("setting", by_name([s for s in ENGINE_SETTINGS if s.flag is not None]))
def test_cli_flag_default_is_the_declared_one(setting: Setting[Any]) -> None:
    args = worker_parser().parse_args(["--model", "m"])
    assert getattr(args, setting.dest) == setting.default


@pytest.mark.parametrize("setting", by_name([s for s in ENGINE_SETTINGS if s.choices]))
def test_cli_flag_choices_are_the_declared_ones(setting: Setting[Any]) -> None:
    (action,) = [a for a in worker_parser()._actions if setting.flag in a.option_strings]
    assert tuple(action.choices or ()) == setting.choices


def test_llm_keyword_defaults_are_the_declared_ones() -> None:
    params = inspect.signature(LLM.__init__).parameters
    named = [name for name in params if name not in ("self", "model", "progress", "engine_kwargs")]
    assert named == ["policy", "token_budget", "max_batch_size", "pipeline_stages", "tensor_parallel_size",
                     "dtype", "block_size", "kv_cache_tokens"]
    for name in named:
        assert params[name].default == settings.engine_setting(name).default, name


@pytest.mark.parametrize("setting", by_name(CRD_EXPOSED))
@pytest.mark.parametrize("source", ["python", "chart"])
def test_crd_field_agrees_with_the_declaration(setting: Setting[Any], source: str) -> None:
    assert setting.crd is not None
    schema = crd.spec_schema() if source == "python" else chart_spec_schema()
    node = schema_node(schema, setting.crd.path)
    declared = {"minimum": setting.minimum, "maximum": setting.maximum, "default": setting.default,
                **setting.crd.overrides}
    for key in ("minimum", "maximum", "default"):
        assert node.get(key) == declared[key], f"{setting.crd.path}.{key}"
    assert node.get("enum", []) == list(setting.choices)


@pytest.mark.parametrize("setting", by_name(CRD_EXPOSED))
def test_operator_spec_default_agrees_with_the_crd_default(setting: Setting[Any]) -> None:
    cls, part, attr = SPEC_FIELDS[setting.name]
    (field,) = [f for f in dataclasses.fields(cls) if f.name == attr]
    assert field.default == setting.crd_default()
    parsed = parse_spec({"model": {"uri": "preset://tiny"}}, "demo")  # the CRD's defaults, applied
    assert getattr(getattr(parsed, part) if part else parsed, attr) == setting.crd_default()


def test_every_crd_exposed_setting_has_a_spec_field() -> None:
    assert sorted(SPEC_FIELDS) == sorted(s.name for s in CRD_EXPOSED)


def test_only_the_declared_overrides_make_the_cluster_differ() -> None:
    differing = {s.name for s in CRD_EXPOSED if s.crd_default() != s.default}
    assert differing == {"rendezvous_timeout_s"}  # declared, with its reason, in its CrdField


def test_an_override_without_a_reason_is_refused() -> None:
    with pytest.raises(ValueError, match="need a reason"):
        CrdField("scheduler.maxBatchSize", "x", overrides={"default": 64})


def test_flags_round_trip_through_the_config() -> None:
    config = EngineConfig(model="m", policy="vllm", token_budget=4096, max_batch_size=7, pipeline_stages=2,
                          dtype="float32", layer_split=(1, 1), stage_timeout_s=3.0, prefix_caching=False,
                          attention_aware_chunks=False, seed=5, kv_cache_tokens=256)
    args = worker_parser().parse_args(config_to_argv(config))
    assert config_from_args(args) == config


def test_rendered_worker_flags_are_worker_flags() -> None:
    parsed = parse_spec({"model": {"uri": "preset://tiny"}, "parallelism": {"pipeline": 2},
                         "scheduler": {"tokenBudget": 256}}, "demo")
    source = render.model_source(parsed)
    args = worker_parser().parse_args(render.engine_args(parsed, source))
    assert (args.stages, args.token_budget, args.rendezvous_timeout) == (2, 256, 1200)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("max_batch_size", 0, "must be a positive integer, got 0"),
    ("max_batch_size", True, "must be a positive integer, got True"),
    ("block_size", 2048, r"must be in \[1, 1024\], got 2048"),
    ("kv_cache_memory_fraction", 0.0, r"must be in \(0, 1\], got 0.0"),
    ("watermark", 1.0, r"must be in \[0, 1\), got 1.0"),
    ("dtype", "int8", "must be one of auto, float32, float16, bfloat16, got 'int8'"),
    ("policy", "lifo", "must be one of sarathi, vllm, orca, fastertransformer, got 'lifo'"),
    ("stage_timeout_s", 4000, r"must be in \(0, 3600\], got 4000"),
])
def test_engine_config_refuses_out_of_bounds_values_naming_the_field(field: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{field}: {message}$"):
        EngineConfig(model="m", **{field: value})


def test_engine_core_default_is_declared_once() -> None:
    from chariot.cli.main import parser

    for command in (["worker", "--model", "m"], ["up"]):
        assert parser().parse_args(command).engine_core == ENGINE_CORE.default
    from chariot.cli.groups import GroupSupervisor
    from chariot.worker.pipeline.launcher import start_group

    assert inspect.signature(start_group).parameters["engine_core"].default == ENGINE_CORE.default
    assert inspect.signature(GroupSupervisor).parameters["engine_core"].default == ENGINE_CORE.default
    from chariot.worker.server import serve  # no default of its own: callers pass the declared setting

    assert inspect.signature(serve).parameters["engine_core"].default is inspect.Parameter.empty


@pytest.mark.parametrize(("device", "block_size", "expected"),
                         [("cpu", None, 128), ("cuda", None, 16), ("cuda:1", None, 16), ("cpu", 16, 16),
                          ("cuda", 64, 64)])
def test_block_size_defaults_by_device(device: str, block_size: int | None, expected: int) -> None:
    """Unset, the KV-cache block size is the device's: 128 tokens on a CPU, where a decode streams the
    cache and longer runs of one head's keys stream faster (docs/kernels.md), 16 on a GPU; a set one
    stands, on any device."""
    config = EngineConfig(model="m", device=device, block_size=block_size)
    assert config.block_tokens == expected
    parsed = config_from_args(worker_parser().parse_args(config_to_argv(config)))
    assert parsed.block_size == block_size and parsed.block_tokens == expected
