"""Builds of the package's C++ CPU kernels: one for this CPU, cached, or a portable one an image carries.

Each kernel (`KERNELS`, `csrc/*.cpp`) is built against the installed torch
(`torch.utils.cpp_extension.load`, so no isolated build environment and no second torch) with `-O3
-fopenmp` and one of two targets:

- **native** (`-march=native`): into `$CHARIOT_KERNEL_CACHE` (default `~/.cache/chariot/kernels`)
  `/<stem>-<key>`, the key a hash of the source (and the headers beside it), the flags, torch's
  version, the machine and this CPU's feature flags. A CPU with other flags gets another key, so a
  cache volume shared by nodes of several CPU models holds one build per model and never hands one
  a binary built for another.
- **baseline** (`-march=x86-64-v3`: AVX2, FMA, BMI1/2, F16C, LZCNT, MOVBE): into a read-only directory
  the image build fills (`python -m chariot.kernels.cpu_build prebuild --baseline DIR`), read from
  `$CHARIOT_KERNEL_BASELINE` (default `/opt/chariot/kernels-baseline`), keyed alike but by the ISA it
  targets instead of the build machine's CPU flags.

Every build directory carries `build.json`, which records the CPU flags a CPU needs to run it (a
native build: every flag of the CPU that built it; a baseline build: x86-64-v3's). A build is loaded
only where this CPU has all of them, on the machine it was built for.

Which build a process loads (`$CHARIOT_KERNEL_BUILD`): `auto` (the default) loads this CPU's build
from the cache; else a baseline build this CPU can run, without compiling, and says that a native
build is faster and how to make one; else it compiles the native build into the cache (~25 s per
kernel). `native` never takes the baseline (benchmarks); `baseline` takes only the baseline, and is
an error where there is none this CPU can run. `python -m chariot.kernels.cpu_build prebuild
--native` compiles this CPU's builds into the cache (an init container or an operator warming a
node's cache volume); `... status` says what each kernel would load here.

Every build registers its ops under its own namespace (`chariot_<stem>_<key>`), so two revisions of
one kernel, or its native and baseline builds, can be loaded side by side (benchmarks time one
against the other).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from chariot.kernels import knobs

__all__ = [
    "BASELINE_FLAGS",
    "BASELINE_ISA",
    "BASELINE_REQUIRES",
    "CACHE_ENV",
    "FLAGS",
    "KERNELS",
    "Build",
    "Kernel",
    "baseline_build",
    "build_dir",
    "build_problem",
    "cpu_flags",
    "load_ops",
    "native_build",
    "prebuild_baseline",
    "prebuild_native",
    "refusal",
]

log = logging.getLogger(__name__)
CACHE_ENV = knobs.KERNEL_CACHE
BASELINE_ENV = knobs.KERNEL_BASELINE
BUILD_ENV = knobs.KERNEL_BUILD
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=fast", "-fno-math-errno", "-fno-trapping-math")
BASELINE_ISA = "x86-64-v3"
BASELINE_FLAGS = tuple(f"-march={BASELINE_ISA}" if flag == "-march=native" else flag for flag in FLAGS)
BASELINE_MACHINE = "x86_64"
BASELINE_REQUIRES = frozenset({
    "cmov", "cx8", "fpu", "fxsr", "mmx", "sse", "sse2",  # x86-64
    "cx16", "lahf_lm", "popcnt", "pni", "ssse3", "sse4_1", "sse4_2",  # -v2 (`pni` is SSE3)
    "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave",  # -v3 (`abm` is LZCNT)
})
"""The CPU flags (as /proc/cpuinfo names them) of every instruction set `-march=x86-64-v3` may use."""
NATIVE = "native"
RECORD = "build.json"
PREBUILD_NATIVE = "python -m chariot.kernels.cpu_build prebuild --native"
COMPILE_SECONDS = 25  # measured on a 2-core AVX2 EPYC; shown when compiling


@dataclass(frozen=True)
class Kernel:
    """One C++ kernel of the package: its build's stem, its source and what the log calls it."""

    stem: str
    source: Path
    what: str


CSRC = Path(__file__).parent / "csrc"
KERNELS: tuple[Kernel, ...] = (
    Kernel("cpu_attention", CSRC / "paged_attention.cpp", "CPU attention kernel"),
    Kernel("cpu_layer_ops", CSRC / "layer_ops.cpp", "CPU layer kernels"),
    Kernel("cpu_linear", CSRC / "skinny_linear.cpp", "CPU linear kernel"),
    Kernel("cpu_panel_linear", CSRC / "panel_linear.cpp", "CPU panel linear kernel"),
)
"""Every kernel the modules load (`tests/unit/test_cpu_build.py` holds it equal to them), so a prebuild
covers them all."""


@dataclass(frozen=True)
class Build:
    """One build of one kernel: `target` is `native` or BASELINE_ISA; it lives in `root/<stem>-<key>`."""

    stem: str
    target: str
    key: str
    root: Path

    @property
    def name(self) -> str:
        """The library's name and its ops' namespace."""
        return f"chariot_{self.stem}_{self.key}"

    @property
    def directory(self) -> Path:
        return self.root / f"{self.stem}-{self.key}"

    @property
    def library(self) -> Path:
        return self.directory / f"{self.name}.so"

    @property
    def flags(self) -> tuple[str, ...]:
        return FLAGS if self.target == NATIVE else BASELINE_FLAGS


COMPILED: list[str] = []
"""The builds (`Build.name`) this process compiled, in order."""
LOADED: dict[str, Build] = {}
"""The build this process loaded for each library name."""
_told: set[str] = set()


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags: the first `flags` (x86) or `Features` (Arm) line of /proc/cpuinfo
    (empty where there is none: no baseline build loads there, a native one is compiled)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return frozenset()
    line = next((x for x in lines if x.startswith(("flags", "Features"))), "")
    return frozenset(line.partition(":")[2].split())


def _key(source: Path, stem: str, flags: Sequence[str], target: Sequence[str]) -> str:
    h = hashlib.sha256(source.read_bytes())
    for header in sorted(source.parent.glob("*.h")):
        h.update(header.read_bytes())
    for part in (stem, *flags, torch.__version__, platform.machine(), *target):
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:16]


def digest(source: Path, stem: str) -> str:
    """The native build's key: the source and the headers beside it, the flags, torch, the machine and
    this CPU's flags."""
    return _key(source, stem, FLAGS, sorted(cpu_flags()))


def baseline_digest(source: Path, stem: str) -> str:
    """The baseline build's key: as the native one's, with the ISA it targets instead of this CPU's flags."""
    return _key(source, stem, BASELINE_FLAGS, (BASELINE_ISA,))


def native_build(source: Path, stem: str) -> Build:
    """This CPU's build of `source`, in `$CHARIOT_KERNEL_CACHE`."""
    return Build(stem, NATIVE, digest(source, stem), knobs.kernel_cache())


def baseline_build(source: Path, stem: str, root: Path | None = None) -> Build:
    """The portable build of `source`, in `root` (default `$CHARIOT_KERNEL_BASELINE`)."""
    return Build(stem, BASELINE_ISA, baseline_digest(source, stem), root or knobs.kernel_baseline())


def build_dir(source: Path, stem: str) -> Path:
    """Where this CPU's build lives: `$CHARIOT_KERNEL_CACHE` (default ~/.cache/chariot/kernels)/<stem>-<key>."""
    return native_build(source, stem).directory


def _record(build: Build) -> dict[str, object]:
    requires = cpu_flags() if build.target == NATIVE else BASELINE_REQUIRES
    return {"name": build.name, "stem": build.stem, "target": build.target, "machine": platform.machine(),
            "requires": sorted(requires), "flags": list(build.flags), "torch": torch.__version__}


def _write_record(build: Build) -> None:
    tmp = build.directory / f".{RECORD}.{os.getpid()}"
    tmp.write_text(json.dumps(_record(build), indent=1) + "\n")
    tmp.replace(build.directory / RECORD)


def _finished(build: Build) -> dict[str, object] | None:
    """The build's record where the build is complete (its library and a record naming it), else None."""
    try:
        record = json.loads((build.directory / RECORD).read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(record, dict) and record.get("name") == build.name and build.library.is_file()
    return record if ok else None


def refusal(build: Build) -> str | None:
    """Why this CPU must not load `build`, or None where it may: no finished build there, a build for
    another machine, or CPU flags it was built for that this CPU lacks."""
    record = _finished(build)
    if record is None:
        return "no finished build"
    machine = record.get("machine")
    if machine != platform.machine():
        return f"built for {machine}, this machine is {platform.machine()}"
    requires = record.get("requires")
    if not isinstance(requires, list) or not requires:
        return f"its record ({build.directory / RECORD}) does not say which CPU flags it needs"
    missing = sorted(set(requires) - cpu_flags())
    if missing:
        return f"this CPU lacks flags it was built for: {' '.join(missing)}"
    return None


def _load_library(path: Path) -> None:
    torch.ops.load_library(str(path))


def _try_load(build: Build, what: str) -> str | None:
    """Load `build` where this CPU may; why not otherwise."""
    problem = refusal(build)
    if problem is None:
        try:
            _load_library(build.library)
        except (OSError, RuntimeError) as exc:
            lines = str(exc).strip().splitlines()
            problem = f"it did not load ({type(exc).__name__}: {lines[-1] if lines else ''})"
            log.warning("the %s build of the %s in %s %s", build.target, what, build.directory, problem)
    return problem


def _compile(source: Path, build: Build, what: str) -> None:
    """Compile `source` into `build`'s directory (loading it too) and write its record."""
    from torch.utils.cpp_extension import load

    build.directory.mkdir(parents=True, exist_ok=True)
    _put_venv_on_path()  # torch runs `ninja` from PATH; the `ninja` wheel puts it beside this Python
    log.warning("compiling the %s for %s (~%d s) into %s ...", what, "this CPU" if build.target == NATIVE
                else BASELINE_ISA, COMPILE_SECONDS, build.directory)
    t0 = time.perf_counter()
    load(name=build.name, sources=[str(source)], build_directory=str(build.directory), is_python_module=False,
         extra_cflags=[*build.flags, f"-DCHARIOT_OPS_NAMESPACE={build.name}"], extra_ldflags=["-fopenmp"],
         verbose=False)
    _write_record(build)
    COMPILED.append(build.name)
    log.warning("%s compiled in %.0f s", what, time.perf_counter() - t0)


def _put_venv_on_path() -> None:
    bin_dir = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "")
    if bin_dir not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([bin_dir, path]) if path else bin_dir


def _tell_baseline(build: Build, what: str, mode: str) -> None:
    """Say (once per build) that the baseline build is in use and, once per process under `auto`, that
    this CPU's builds are faster and how to make them: a warning where this CPU has wider vectors."""
    if build.name in _told:
        return
    _told.add(build.name)
    log.info("loaded the portable %s build of the %s from %s", BASELINE_ISA, what, build.directory)
    if mode != "auto" or "hint" in _told:
        return
    _told.add("hint")
    flags = cpu_flags()
    wider = [name for flag, name in (("avx512f", "AVX-512"), ("avx512_bf16", "AVX512-BF16")) if flag in flags]
    faster = f"are faster (this CPU has {' and '.join(wider)})" if wider else "may be a little faster (tuned for it)"
    log.log(logging.WARNING if wider else logging.INFO,
            "the C++ CPU kernels run their portable %s (AVX2) builds, with no compile; builds for this CPU %s: "
            "`%s` compiles them into %s (%s; ~%d s per kernel, loaded at every later start on this CPU model), "
            "or %s=native compiles them at start", BASELINE_ISA, faster, PREBUILD_NATIVE, knobs.kernel_cache(),
            CACHE_ENV, COMPILE_SECONDS, BUILD_ENV)


def select(source: Path, stem: str, what: str) -> Build:
    """Load the build of `source` that `$CHARIOT_KERNEL_BUILD` asks for (see the module's docstring),
    compiling this CPU's build when that is what it comes to; returns the build loaded."""
    mode = knobs.kernel_build()
    native = native_build(source, stem)
    if mode != "baseline" and _try_load(native, what) is None:
        return native
    if mode != NATIVE:
        baseline = baseline_build(source, stem)
        problem = _try_load(baseline, what)
        if problem is None:
            _tell_baseline(baseline, what, mode)
            return baseline
        if mode == "baseline":
            raise RuntimeError(f"{BUILD_ENV}=baseline, but the {what} has no {BASELINE_ISA} build this CPU can "
                               f"run in {baseline.root} ({BASELINE_ENV}): {baseline.directory.name}: {problem}")
        log.debug("no baseline build of the %s: %s", what, problem)
    _compile(source, native, what)
    return native


def load_ops(source: Path, stem: str, what: str) -> Callable[[str], Callable[..., None]]:
    """Load (building first where `select` comes to that) the library of `source`; returns op name -> op.

    `stem` names the build (`chariot_<stem>_<key>`, ops in namespace `chariot_<stem>_<key>`);
    `what` is how the log calls it. Raises when it cannot be built (no compiler, no ninja)."""
    build = select(source, stem, what)
    LOADED[build.name] = build
    ops = getattr(torch.ops, build.name)
    return lambda op: getattr(ops, op)


def build_problem(load: Callable[[], object], what: str) -> str | None:
    """Why `load()` (a kernel's loader) cannot build or load it here, or None when it can."""
    try:
        load()
    except Exception as exc:  # a compiler error, a missing compiler or ninja: all mean "not here"
        lines = str(exc).strip().splitlines()
        return f"the {what} did not build ({type(exc).__name__}: {lines[-1] if lines else ''})"
    return None


def _kernels(stems: Sequence[str] | None) -> tuple[Kernel, ...]:
    return KERNELS if not stems else tuple(k for k in KERNELS if k.stem in stems)


def prebuild_baseline(root: Path, stems: Sequence[str] | None = None) -> list[Build]:
    """Compile the kernels (all, or those of `stems`) for BASELINE_ISA into `root`, each in its own
    directory holding only the library and its record; a finished one is kept. Each is built aside and
    renamed into place, so the directory never holds half a build. x86-64 only (RuntimeError elsewhere)."""
    if platform.machine() != BASELINE_MACHINE:
        raise RuntimeError(f"the baseline build targets {BASELINE_ISA} ({BASELINE_MACHINE}); this machine is "
                           f"{platform.machine()}")
    builds = []
    for kernel in _kernels(stems):
        build = baseline_build(kernel.source, kernel.stem, root)
        if _finished(build) is None:
            aside = Build(build.stem, build.target, build.key, root / f".partial-{os.getpid()}")
            shutil.rmtree(aside.directory, ignore_errors=True)
            _compile(kernel.source, aside, kernel.what)
            for path in aside.directory.iterdir():  # objects, ninja files, the lock: not needed to load
                if path.name not in (aside.library.name, RECORD):
                    if path.is_dir():
                        shutil.rmtree(path)
                    else:
                        path.unlink()
            shutil.rmtree(build.directory, ignore_errors=True)  # an unfinished one
            aside.directory.rename(build.directory)
            shutil.rmtree(aside.root, ignore_errors=True)
        log.info("%s: %s", kernel.what, build.directory)
        builds.append(build)
    return builds


def prebuild_native(stems: Sequence[str] | None = None) -> list[Build]:
    """Compile this CPU's builds of the kernels (all, or those of `stems`) into `$CHARIOT_KERNEL_CACHE`,
    where they are not there already."""
    builds = []
    for kernel in _kernels(stems):
        build = native_build(kernel.source, kernel.stem)
        if refusal(build) is not None:
            _compile(kernel.source, build, kernel.what)
        log.info("%s: %s", kernel.what, build.directory)
        builds.append(build)
    return builds


def status() -> list[str]:
    """One line per kernel: its native and baseline builds, and which one `$CHARIOT_KERNEL_BUILD` loads here."""
    mode = knobs.kernel_build()
    lines = [f"{BUILD_ENV}={mode}; this CPU's flags cover {BASELINE_ISA}: "
             f"{'yes' if cpu_flags() >= BASELINE_REQUIRES else 'no'}"]
    for kernel in KERNELS:
        native, baseline = native_build(kernel.source, kernel.stem), baseline_build(kernel.source, kernel.stem)
        native_problem, baseline_problem = refusal(native), refusal(baseline)
        if mode != "baseline" and native_problem is None:
            loads = "native (cached)"
        elif mode != NATIVE and baseline_problem is None:
            loads = BASELINE_ISA
        else:
            loads = "an error" if mode == "baseline" else "native, compiled first"
        lines.append(f"{kernel.stem}: loads {loads}; native {native.directory}: {native_problem or 'ready'}; "
                     f"baseline {baseline.directory}: {baseline_problem or 'ready'}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chariot.kernels.cpu_build",
                                     description="Build the C++ CPU kernels ahead of their first use.")
    sub = parser.add_subparsers(dest="command", required=True)
    pre = sub.add_parser("prebuild", help="compile the kernels: portable (--baseline DIR) or for this CPU (--native)")
    target = pre.add_mutually_exclusive_group(required=True)
    target.add_argument("--baseline", type=Path, metavar="DIR",
                        help=f"compile for {BASELINE_ISA} (AVX2, FMA) into DIR, as an image carries them "
                             f"(read at run time from {BASELINE_ENV}, default {knobs.KERNEL_BASELINE_DEFAULT})")
    target.add_argument("--native", action="store_true",
                        help=f"compile for this CPU into {CACHE_ENV} (default {knobs.KERNEL_CACHE_DEFAULT})")
    pre.add_argument("--kernel", action="append", choices=[k.stem for k in KERNELS],
                     help="only this kernel (repeatable; default: all)")
    sub.add_parser("status", help="what each kernel would load here, and why")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "status":
        print("\n".join(status()))
        return 0
    if args.native:
        prebuild_native(args.kernel)
        return 0
    if platform.machine() != BASELINE_MACHINE:
        print(f"no baseline build on {platform.machine()}: it targets {BASELINE_ISA} ({BASELINE_MACHINE}); "
              f"the kernels compile for this CPU on first use (or ahead of it: `{PREBUILD_NATIVE}`)",
              file=sys.stderr)
        return 0
    prebuild_baseline(args.baseline, args.kernel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
