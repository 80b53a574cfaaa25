"""Engine flags: one definition shared by `chariot worker`, `chariot generate`, `chariot up` and the
local launcher, which turns an `EngineConfig` back into the same flags for child stage processes.

The flags are generated from `chariot.contracts.engine_settings` (name, type, default, choices, help),
so a flag's default is the `EngineConfig` default by construction.
"""

from __future__ import annotations

import argparse
from typing import Any

from chariot.contracts.engine_settings import ENGINE_SETTINGS, Setting, parse_int_tuple
from chariot.worker.config import EngineConfig


def add_setting_flag(group: Any, setting: Setting[Any]) -> None:
    """`setting`'s flag on an argparse parser or group: its type, default and choices from the declaration."""
    assert setting.flag is not None, f"{setting.name} has no command line flag"
    if setting.kind is bool:  # a setting on by default has a `--no-...` flag
        group.add_argument(setting.flag, dest=setting.dest, action="store_false", help=setting.help)
        return
    shown = "" if setting.default is None else f" (default {setting.default})"
    group.add_argument(setting.flag, type=parse_int_tuple if setting.kind is tuple else setting.kind,
                       default=setting.default, choices=setting.choices or None, help=setting.help + shown)


def add_engine_flags(p: argparse.ArgumentParser, model_required: bool = True) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", required=model_required, help="Hugging Face model directory")
    g.add_argument("--tbt-slo-ms", type=float, default=None,
                   help="derive sarathi's token budget from this P99 TBT SLO and the `chariot tune` profile "
                        "(instead of --token-budget)")
    g.add_argument("--tune-profile", default=None,
                   help="profile written by `chariot tune` (default ~/.cache/chariot/tune/<model>-<dtype>.json)")
    for setting in ENGINE_SETTINGS:
        if setting.flag is not None:
            add_setting_flag(g, setting)


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The engine configuration; `--tbt-slo-ms` is resolved into a token budget here, once, so child
    stages receive the resolved `--token-budget`."""
    from chariot.worker.budget import budget_from_flags

    budget = budget_from_flags(args.model, args.dtype, args.policy, args.token_budget, args.tbt_slo_ms,
                               args.tune_profile, args.max_model_len)
    values = {s.name: getattr(args, s.dest) for s in ENGINE_SETTINGS if s.flag is not None}
    return EngineConfig(model=args.model, **{**values, "token_budget": budget})


def config_to_argv(c: EngineConfig) -> list[str]:
    """The flags that reproduce `c` (inverse of `config_from_args`)."""
    argv = ["--model", c.model]
    for setting in ENGINE_SETTINGS:
        value = getattr(c, setting.name)
        if setting.flag is None or value is None:
            continue
        if setting.kind is bool:
            argv += [] if value else [setting.flag]
        elif setting.kind is tuple:
            argv += [setting.flag, ",".join(map(str, value))] if value else []
        else:
            argv += [setting.flag, str(value)]
    return argv
