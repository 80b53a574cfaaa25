"""Every `CHARIOT_*` environment variable, declared once, with the typed readers the code uses.

Why a registry: a knob read where it is used is invisible to anyone who did not write that line. Here
each one has its name, what it takes, its default, what it does and which modules read it, and
`docs/configuration.md` lists them from this table (`tests/unit/test_environment.py` fails when a
`CHARIOT_*` name appears in the source without being declared here, when code reads one around these
readers, or when the doc is stale).

Why in `chariot.contracts`: the registry is a shared contract, and the contracts package is torch-free
and imports nothing of Chariot but `chariot.proto`, so every package at or above it (the worker, the
router, the operator, which reads `CHARIOT_IMAGE` and must start without torch, the benchmarks, the
CLI and the tests) reads its knobs through this module. The kernels are the exception: they read five
of these knobs (`CHARIOT_ATTENTION_BACKEND`, `CHARIOT_KERNEL_CACHE`, `CHARIOT_KERNEL_BASELINE`,
`CHARIOT_KERNEL_BUILD`, `CHARIOT_CPU_LAYER_OPS`) but sit below `chariot.contracts` in the stack, so they
cannot import it; `kernels/knobs.py` reads those five with the same semantics (standard library only). They are still
declared here, and `tests/unit/test_environment.py` checks that its names and defaults equal these
declarations, so the two cannot drift. This module imports nothing but the standard library.

Knobs are read when used, not once at start-up: tests and benchmarks set them per run, and child
processes inherit them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["KNOBS", "Knob", "is_on", "knob", "markdown_table", "read", "read_path"]


@dataclass(frozen=True)
class Knob:
    """One environment variable: `values` says what it takes, `default` is what an unset (or empty)
    variable means, `readers` the repository files that read it. Where `choices` is set, `read`
    refuses anything else."""

    name: str
    values: str
    default: str | None
    help: str
    readers: tuple[str, ...]
    choices: tuple[str, ...] = ()


def read(k: Knob) -> str | None:
    """The variable's value (an empty one counts as unset), else its default; a value outside the
    knob's `choices` raises ValueError naming the variable and what it takes."""
    value = os.environ.get(k.name) or k.default
    if k.choices and value not in k.choices:
        raise ValueError(f"{k.name} must be {', '.join(k.choices[:-1])} or {k.choices[-1]}, got {value!r}")
    return value


def is_on(k: Knob) -> bool:
    """A switch that is on unless set to `0`."""
    return read(k) != "0"


def read_path(k: Knob) -> Path:
    """A directory knob as a path (`~` expanded)."""
    value = read(k)
    if value is None:
        raise ValueError(f"{k.name} has no default and is not set")
    return Path(value).expanduser()


ATTENTION_BACKEND = Knob(
    "CHARIOT_ATTENTION_BACKEND", "`reference` \\| `triton` \\| `cpu`", None,
    "the paged-attention backend; unset: `triton` with CUDA and triton, else the C++ CPU kernel, else the "
    "reference (with a warning). A backend that cannot run is an error, never a silent fallback",
    ("kernels/__init__.py",))
KERNEL_CACHE = Knob(
    "CHARIOT_KERNEL_CACHE", "directory", "~/.cache/chariot/kernels",
    "where the C++ CPU kernels are built for this CPU (`-march=native`) and cached, one build per source, "
    "flags, torch and CPU flags; a volume here keeps them across restarts (docs/kernels.md)",
    ("kernels/cpu_build.py",))
KERNEL_BASELINE = Knob(
    "CHARIOT_KERNEL_BASELINE", "directory", "/opt/chariot/kernels-baseline",
    "read-only portable (x86-64-v3: AVX2, FMA) builds of the C++ CPU kernels, as the image carries them "
    "(`python -m chariot.kernels.cpu_build prebuild --baseline DIR`); loaded when the cache has no build "
    "for this CPU and this CPU has every flag they need",
    ("kernels/cpu_build.py",))
KERNEL_BUILD = Knob(
    "CHARIOT_KERNEL_BUILD", "`auto` \\| `native` \\| `baseline`", "auto",
    "which build of the C++ CPU kernels loads: `auto` this CPU's cached build, else a baseline build it can "
    "run, else a compile for this CPU; `native` always this CPU's build (compiled when not cached: "
    "benchmarks); `baseline` only the baseline build (an error when none fits)",
    ("kernels/cpu_build.py",), choices=("auto", "native", "baseline"))
CPU_LAYER_OPS = Knob(
    "CHARIOT_CPU_LAYER_OPS", "`0` \\| `1`", "1",
    "`0` runs RMSNorm, RoPE, SiLU-and-mul and the KV write in PyTorch instead of the fused C++ kernels (A/B runs)",
    ("kernels/cpu_layer_ops.py",))
CPU_KEEP_FREED_MEMORY = Knob(
    "CHARIOT_CPU_KEEP_FREED_MEMORY", "`0` \\| `1`", "1",
    "`0` leaves glibc malloc's thresholds alone (default: freed activation buffers stay mapped for the next "
    "step instead of returning to the kernel)", ("worker/host_memory.py",))
CPU_PACKED_LINEAR = Knob(
    "CHARIOT_CPU_PACKED_LINEAR", "`0` \\| `1`", "1",
    "`0` turns off oneDNN weight packing of the CPU linear layers", ("worker/model/cpu_linear.py",))
CPU_SKINNY_LINEAR = Knob(
    "CHARIOT_CPU_SKINNY_LINEAR", "`auto` \\| `0` \\| `1`", "auto",
    "the few-rows (decode) linear kernel beside packed weights: `auto` keeps it when the second weight copy "
    "fits in memory, `1` always, `0` never", ("worker/model/cpu_linear.py",), choices=("auto", "0", "1"))
CPU_SKINNY_MAX_ROWS = Knob(
    "CHARIOT_CPU_SKINNY_MAX_ROWS", "integer >= 0 \\| `all`", None,
    "the most rows a step may have to take the few-rows kernel; unset: measured at start-up",
    ("worker/model/cpu_linear.py",))
CPU_PANEL_LINEAR = Knob(
    "CHARIOT_CPU_PANEL_LINEAR", "`0` \\| `1`", "1",
    "`0` keeps the skinny kernel where the panel kernel would replace the plain weight copy",
    ("worker/model/cpu_linear.py",))
CPU_BF16_UPCAST = Knob(
    "CHARIOT_CPU_BF16_UPCAST", "`auto` \\| `0` \\| `1`", "auto",
    "bf16 linear layers' many-rows (prefill) route computes in float32 on a float32 copy of the weights packed "
    "for oneDNN: `auto` where that measures faster at start-up (a CPU whose bf16 dot products run slower than "
    "its float32 FMAs) and the copy fits in memory, `1` always, `0` never", ("worker/model/cpu_linear.py",),
    choices=("auto", "0", "1"))
STAGE_CPUS = Knob(
    "CHARIOT_STAGE_CPUS", "core sets, e.g. `0,1` or `0+1,2+3`", None,
    "pins pipeline stage r to the r-th core set (`+` joins cores) with as many torch threads: benchmarks of "
    "several stages on one machine", ("worker/runtime.py",))
RENDEZVOUS_FD = Knob(
    "CHARIOT_RENDEZVOUS_FD", "file descriptor number", None,
    "set by `chariot up` and the benchmarks for a local group's stage 0 only: its rendezvous socket, already "
    "listening on `MASTER_PORT` (pods bind their own)", ("contracts/processes.py",))
IMAGE = Knob(
    "CHARIOT_IMAGE", "image reference", None,
    "the operator's `--image` default: the image of workers and routers when a spec sets none (unset: the "
    "operator's own release image)", ("operator/cli.py",))
REDIS_URL = Knob(
    "CHARIOT_REDIS_URL", "`redis://`, `rediss://` or `unix://` URL", None,
    "the operator's `--redis-url` default: shared state for routers of deployments that set no "
    "`spec.router.redis.url`", ("operator/cli.py",))
REDIS_SERVER = Knob(
    "CHARIOT_REDIS_SERVER", "path to a `redis-server` binary", None,
    "tests only: the Redis the router tests start (unset: `redis-server` on PATH)", ("tests/redis_server.py",))
E2E_COMMAND = Knob(
    "CHARIOT_E2E_COMMAND", "shell words", None,
    "tests only: replaces the `chariot` entry point the local end-to-end tests' pods run (read by "
    "`chariot_command`, which tests/e2e/test_scale_from_zero_e2e.py shares)",
    ("tests/e2e/test_local_e2e.py",))

KNOBS: tuple[Knob, ...] = (
    ATTENTION_BACKEND, KERNEL_CACHE, KERNEL_BASELINE, KERNEL_BUILD, CPU_LAYER_OPS, CPU_KEEP_FREED_MEMORY,
    CPU_PACKED_LINEAR, CPU_SKINNY_LINEAR, CPU_SKINNY_MAX_ROWS, CPU_PANEL_LINEAR, CPU_BF16_UPCAST, STAGE_CPUS,
    RENDEZVOUS_FD, IMAGE, REDIS_URL, REDIS_SERVER, E2E_COMMAND,
)


def knob(name: str) -> Knob:
    """The knob called `name`; KeyError otherwise."""
    for k in KNOBS:
        if k.name == name:
            return k
    raise KeyError(f"{name} is not a declared environment knob (chariot.contracts.environment.KNOBS)")


def markdown_table() -> str:
    """The knobs as the Markdown table `docs/configuration.md` carries."""
    rows = ["| variable | takes | default | what it does | read by |", "|---|---|---|---|---|"]
    for k in KNOBS:
        default = "unset" if k.default is None else f"`{k.default}`"
        readers = ", ".join(f"`{r}`" for r in k.readers)
        rows.append(f"| `{k.name}` | {k.values} | {default} | {k.help} | {readers} |")
    return "\n".join(rows) + "\n"
