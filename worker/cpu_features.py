"""Which reduced-precision dtypes this CPU computes natively, so `--dtype auto` never picks one that
is emulated: on a CPU without bf16 instructions a bf16 matmul runs ~6× slower than float32
(measured: a 1,024-token prefill of the 100m preset takes 9.2 s in bf16 vs 1.4 s in float32 on an
AVX2-only EPYC)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

# CPU flags (as /proc/cpuinfo names them) that make each dtype's matmuls native.
NATIVE_FLAGS: dict[str, frozenset[str]] = {
    "bfloat16": frozenset({"avx512_bf16", "amx_bf16"}),
    "float16": frozenset({"avx512_fp16", "amx_fp16"}),
}
ALWAYS_NATIVE = frozenset({"float32"})


@cache
def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The flags of the first CPU in `cpuinfo`; empty where the file does not exist (not Linux)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def native_on_cpu(dtype_name: str, flags: frozenset[str]) -> bool:
    """Whether a CPU with `flags` computes `dtype_name` natively."""
    return dtype_name in ALWAYS_NATIVE or bool(NATIVE_FLAGS.get(dtype_name, frozenset()) & flags)


def auto_cpu_dtype(checkpoint_dtype: str, flags: frozenset[str]) -> tuple[str, str | None]:
    """The dtype `--dtype auto` runs a `checkpoint_dtype` checkpoint in on this CPU, and why it differs
    from the checkpoint's (None when it does not)."""
    if native_on_cpu(checkpoint_dtype, flags):
        return checkpoint_dtype, None
    needed = " or ".join(sorted(NATIVE_FLAGS.get(checkpoint_dtype, frozenset()))) or "native support"
    return "float32", (f"the checkpoint is {checkpoint_dtype} but this CPU lacks {needed}, so {checkpoint_dtype} "
                       f"would be emulated; running in float32 (pass --dtype {checkpoint_dtype} to force it)")
