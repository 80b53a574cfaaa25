"""CPU linear layers (the serving path) against `nn.Linear`: the skinny kernel for decode rows,
oneDNN-packed weights for the rest, each alone and together; and when each is refused, and why."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from chariot.kernels import panel_linear as panel
from chariot.kernels import skinny_linear as skinny
from chariot.worker.model import cpu_linear
from chariot.worker.model.cpu_linear import (
    ALL_ROWS,
    MANY_ROWS,
    PACKED_LINEAR_ENV,
    PANEL_LINEAR_ENV,
    ROW_CANDIDATES,
    SETTLED_ROWS,
    SKINNY_LINEAR_ENV,
    SKINNY_ROWS_ENV,
    UPCAST_ENV,
    CpuLinear,
    RowsCalibration,
    UpcastCalibration,
    calibrate_skinny_rows,
    calibrate_upcast,
    calibration_layers,
    configured_skinny_rows,
    cpu_linears,
    packing_problem,
    plan_linears,
    skinny_problem,
    upcast_problem,
)
from tests.kernel_builds import vector_256_source

BF16_ROWS = skinny.bf16_rows()  # this machine's build multiplies bf16 rows (AVX512-BF16)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 16, 17, 300])
@pytest.mark.parametrize("out_features", [1, 5, 64, 130])
@pytest.mark.parametrize("in_features", [8, 264])
def test_skinny_kernel_matches_f_linear(rows: int, out_features: int, in_features: int) -> None:
    """Every row-block and output-block remainder (blocks of 3 rows x 4 outputs), with and without bias."""
    gen = torch.Generator().manual_seed(rows * 1000 + out_features + in_features)
    x = torch.randn(rows, in_features, generator=gen)
    w = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen)
    torch.testing.assert_close(skinny.skinny_linear(x, w), F.linear(x, w), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(skinny.skinny_linear(x, w, b), F.linear(x, w, b), atol=1e-4, rtol=1e-4)


def cpu_flags() -> set[str]:
    info = Path("/proc/cpuinfo")
    return set(info.read_text().split()) if info.exists() else set()


def test_bf16_rows_where_the_cpu_has_avx512_bf16(tmp_path: Path) -> None:
    """The native build multiplies bf16 rows exactly when this CPU has AVX512-BF16; the 256-bit build
    (what an AVX2 machine gets) never does."""
    assert ({"avx512_bf16", "avx512bw"} <= cpu_flags()) == BF16_ROWS
    assert not skinny.bf16_rows(vector_256_source(skinny.SOURCE, tmp_path))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 8, 13, 16, 17, 32])
@pytest.mark.parametrize(("out_features", "in_features"), [(1, 32), (5, 64), (130, 1024), (64, 2816)])
def test_bf16_skinny_kernel_within_one_rounding_of_fp32(rows: int, out_features: int, in_features: int) -> None:
    """bf16 rows on bf16 dot products: every row-block (6 rows) and output-block remainder, with and
    without bias, against F.linear in fp32 over the same bf16 values; the only error is the final
    rounding to bf16 (and the order of fp32 sums). Without AVX512-BF16 bf16 is refused by name."""
    gen = torch.Generator().manual_seed(rows * 1000 + out_features + in_features)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    w = (torch.randn(out_features, in_features, generator=gen) / in_features**0.5).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16()
    if not BF16_ROWS:
        assert not skinny.supports(w)
        with pytest.raises(RuntimeError, match="float32"):
            skinny.skinny_linear(x, w)
        return
    assert skinny.supports(w)
    for bias in (None, b):
        ours = skinny.skinny_linear(x, w, bias)
        exact = F.linear(x.float(), w.float(), None if bias is None else bias.float())
        assert ours.dtype == torch.bfloat16
        torch.testing.assert_close(ours.float(), exact, atol=1e-3, rtol=2**-8)


AMX_ROWS = skinny.amx_rows(torch.zeros(32, 32, dtype=torch.bfloat16))  # this machine's build has the tile path


def test_amx_rows_where_the_cpu_has_amx_tiles() -> None:
    """The tile path is there exactly when this CPU has AMX tiles (the native build compiles it in, Linux
    grants the state); only bf16 weights with both sizes multiples of 32 take it."""
    assert ({"amx_tile", "amx_bf16"} <= cpu_flags()) == AMX_ROWS
    if AMX_ROWS:
        assert not skinny.amx_rows(torch.zeros(32, 48, dtype=torch.bfloat16))
        assert not skinny.amx_rows(torch.zeros(48, 32, dtype=torch.bfloat16))
        assert not skinny.amx_rows(torch.zeros(32, 32))


@pytest.mark.parametrize("rows", [1, 2, 5, 15, 16, 17, 24, 31, 32])
@pytest.mark.parametrize(("out_features", "in_features"), [(32, 32), (96, 64), (1536, 1024), (1024, 2816)])
def test_amx_tile_path_within_one_rounding_of_fp32(rows: int, out_features: int, in_features: int) -> None:
    """bf16 rows on AMX tiles, with and without bias: every row count of one and two row tiles, against
    F.linear in fp32 over the same bf16 values (the only error the final rounding to bf16 and the order
    of fp32 sums). Where there are no tiles, packing is refused by name."""
    gen = torch.Generator().manual_seed(rows * 1000 + out_features + in_features)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    w = (torch.randn(out_features, in_features, generator=gen) / in_features**0.5).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16()
    if not AMX_ROWS:
        with pytest.raises(RuntimeError, match="AMX tiles"):
            skinny.amx_pack(w)
        return
    packed = skinny.amx_pack(w)
    assert packed.numel() == w.numel() and packed.dtype == torch.bfloat16
    for bias in (None, b):
        ours = skinny.amx_linear(x, packed, bias, out_features)
        exact = F.linear(x.float(), w.float(), None if bias is None else bias.float())
        assert ours.dtype == torch.bfloat16 and ours.shape == (rows, out_features)
        torch.testing.assert_close(ours.float(), exact, atol=1e-3, rtol=2**-8)


def test_amx_tile_path_refuses_what_it_cannot_do() -> None:
    w = torch.randn(64, 64).bfloat16()
    if not AMX_ROWS:
        with pytest.raises(RuntimeError, match="AMX tiles"):
            skinny.amx_pack(w)
        return
    packed = skinny.amx_pack(w)
    with pytest.raises(RuntimeError, match="at most 32 rows"):
        skinny.amx_linear(torch.randn(33, 64).bfloat16(), packed, None, 64)
    with pytest.raises(RuntimeError, match="packed must hold a"):
        skinny.amx_linear(torch.randn(2, 64).bfloat16(), packed, None, 32)
    with pytest.raises(RuntimeError, match="x must be a contiguous bfloat16"):
        skinny.amx_linear(torch.randn(2, 64), packed, None, 64)
    with pytest.raises(RuntimeError, match=r"bias must be \[N\]"):
        skinny.amx_linear(torch.randn(2, 64).bfloat16(), packed, torch.randn(64), 64)
    assert skinny.amx_linear(torch.empty(0, 64, dtype=torch.bfloat16), packed, None, 64).shape == (0, 64)


def test_bf16_skinny_kernel_refuses_mixed_dtypes_and_odd_sizes() -> None:
    x, w = torch.randn(2, 64).bfloat16(), torch.randn(4, 64).bfloat16()
    with pytest.raises(RuntimeError, match="float32"):
        skinny.skinny_linear(x, w.float())
    if BF16_ROWS:
        with pytest.raises(RuntimeError, match="multiple of 32"):
            skinny.skinny_linear(x[:, :48].contiguous(), w[:, :48].contiguous())
        with pytest.raises(RuntimeError, match=r"bias must be \[N\]"):
            skinny.skinny_linear(x, w, torch.randn(4))  # fp32 bias for a bf16 weight
    assert not skinny.supports(w[:, :48])


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 12, 13, 32, 64, 65, 97, 300])
@pytest.mark.parametrize(("out_features", "in_features"), [(1, 1), (5, 12), (16, 64), (130, 264), (1024, 2816)])
@pytest.mark.parametrize("bias", [False, True])
def test_panel_kernel_matches_f_linear(rows: int, out_features: int, in_features: int, bias: bool) -> None:
    """Every pass remainder (passes of six rows), panels of 16 outputs with a partial last one, any K;
    up to 64 rows W streams once, more take the blocked order (blocks of 256 steps of k, which 264
    and 2816 split into 2 and 11, and of 96 rows, which 97 and 300 split into 2 and 4)."""
    gen = torch.Generator().manual_seed(rows * 1000 + out_features + in_features)
    x = torch.randn(rows, in_features, generator=gen)
    w = torch.randn(out_features, in_features, generator=gen) / in_features**0.5
    b = torch.randn(out_features, generator=gen) if bias else None
    packed = panel.pack(w, b)
    assert packed.panels.shape == (-(-out_features // 16), in_features, 16)
    torch.testing.assert_close(panel.panel_linear(x, packed), F.linear(x, w, b), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
@pytest.mark.parametrize("out_features", [16, 130, 2000])
def test_panel_kernel_hands_out_every_panel_once_whatever_the_thread_count(threads: int, out_features: int) -> None:
    """Prefill chunks take units of panels from a shared counter: one panel (130 outputs, 9 panels),
    up to 8 (2000 outputs, 125 panels; a last unit of 5), more threads than units (16 outputs on 8
    threads); a panel skipped would leave its outputs unset, two threads on one would race on its partial
    sums (the later blocks of k add into y)."""
    gen = torch.Generator().manual_seed(out_features + threads)
    x, w = torch.randn(100, 64, generator=gen), torch.randn(out_features, 64, generator=gen) / 8
    b = torch.randn(out_features, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = panel.panel_linear(x, panel.pack(w, b))
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, F.linear(x, w, b), atol=2e-5, rtol=1e-5)


def test_panel_kernel_takes_strided_rows_and_no_rows() -> None:
    w = torch.randn(40, 32)
    x = torch.randn(7, 64)[:, ::2]  # not contiguous
    torch.testing.assert_close(panel.panel_linear(x, panel.pack(w)), F.linear(x, w), atol=2e-5, rtol=1e-5)
    assert panel.panel_linear(torch.empty(0, 32), panel.pack(w)).shape == (0, 40)


def test_panel_kernel_refuses_what_it_cannot_do() -> None:
    with pytest.raises(ValueError, match="float32 \\[N, K\\] weight"):
        panel.pack(torch.randn(8, 16).bfloat16())
    packed = panel.pack(torch.randn(8, 16))
    with pytest.raises(ValueError, match="x must be float32 \\[M, 16\\]"):
        panel.panel_linear(torch.randn(3, 12), packed)
    with pytest.raises(ValueError, match="x must be float32"):
        panel.panel_linear(torch.randn(3, 16).double(), packed)


def test_skinny_kernel_takes_strided_rows_and_no_rows() -> None:
    x = torch.randn(4, 64)[:, ::2]  # not contiguous: the wrapper copies it
    w = torch.randn(16, 32)
    torch.testing.assert_close(skinny.skinny_linear(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)
    assert skinny.skinny_linear(torch.empty(0, 32), w).shape == (0, 16)


def test_skinny_kernel_refuses_what_it_cannot_do() -> None:
    with pytest.raises(RuntimeError, match="multiple of 8"):
        skinny.skinny_linear(torch.randn(2, 12), torch.randn(4, 12))
    with pytest.raises(RuntimeError, match="float32"):
        skinny.skinny_linear(torch.randn(2, 16), torch.randn(4, 16, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"bias must be \[N\]"):
        skinny.skinny_linear(torch.randn(2, 16), torch.randn(4, 16), torch.randn(5))
    assert not skinny.supports(torch.randn(4, 12)) and not skinny.supports(torch.randn(4, 16, dtype=torch.bfloat16))
    assert skinny.supports(torch.randn(4, 16))


@pytest.mark.parametrize(("packed", "plain"), [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 64, 300])
def test_cpu_linear_equals_nn_linear(packed: bool, plain: bool, bias: bool, rows: int) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(256, 384, bias=bias).eval()
    fast = CpuLinear(linear, packed=packed, plain=plain)
    assert (fast.packed_weight is not None) == packed and fast.skinny == plain
    x = torch.randn(rows, 256)
    with torch.inference_mode():
        torch.testing.assert_close(fast(x), linear(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(fast(x.view(rows, 1, 256)), linear(x).view(rows, 1, 384), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32] + [torch.bfloat16] * (
    packing_problem(torch.device("cpu"), torch.bfloat16) is None))  # bf16 where oneDNN packs it (AVX-512)
def test_the_onednn_route_rounds_rows_up_and_returns_only_the_callers(dtype: torch.dtype) -> None:
    """Every row count through oneDNN's packed route runs as the next multiple of ONEDNN_ROW_STEP
    (zero rows added): the caller gets exactly its rows, contiguous, equal to `nn.Linear` on them,
    whether or not the count needed rounding."""
    torch.manual_seed(0)
    linear = nn.Linear(256, 384).to(dtype).eval()
    fast = CpuLinear(linear, packed=True, plain=False)
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
    step = cpu_linear.ONEDNN_ROW_STEP
    with torch.inference_mode():
        for rows in (1, step - 1, step, step + 1, 5 * step + 3, 300):
            x = torch.randn(rows, 256).to(dtype)
            ours = fast(x)
            assert ours.shape == (rows, 384) and ours.is_contiguous()
            torch.testing.assert_close(ours.float(), linear(x).float(), **tol)


@pytest.mark.parametrize("rows", [1, 3, 17, 64])
def test_bf16_cpu_linear_equals_nn_linear(rows: int) -> None:
    """A bf16 layer keeping both weights where oneDNN packs bf16 (AVX-512, AVX-NE-CONVERT), else the
    plain one only: rows up to the limit take the skinny kernel (where the build has bf16 rows), the
    rest oneDNN or `F.linear`; all agree with eager bf16 `nn.Linear` to bf16 precision."""
    torch.manual_seed(rows)
    linear = nn.Linear(256, 384).to(torch.bfloat16).eval()
    packs_bf16 = packing_problem(torch.device("cpu"), torch.bfloat16) is None
    fast = CpuLinear(linear, packed=packs_bf16, plain=True)
    assert fast.skinny == BF16_ROWS
    assert (fast.tiles is not None) == AMX_ROWS and (fast.weight is None) == AMX_ROWS  # the tiles replace it
    assert fast.few_rows_cap == (skinny.AMX_MAX_ROWS if AMX_ROWS and packs_bf16 else skinny.MAX_ROWS
                                 if not AMX_ROWS else ALL_ROWS)
    x = torch.randn(rows, 256).bfloat16()
    with torch.inference_mode():
        ours = fast(x)
        assert ours.dtype == torch.bfloat16
        torch.testing.assert_close(ours.float(), linear(x).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("rows", [1, 40, 100])
def test_the_tiles_copy_alone_takes_every_row_count(rows: int) -> None:
    """With oneDNN's copy refused (`CHARIOT_CPU_PACKED_LINEAR=0`), a bf16 layer on AMX keeps only the
    tiles' copy, which takes any number of rows, 32 at a time."""
    linear = nn.Linear(64, 96, bias=True).to(torch.bfloat16).eval()
    fast = CpuLinear(linear, packed=False, plain=True)
    if not AMX_ROWS:
        assert fast.tiles is None
        return
    assert fast.tiles is not None and fast.weight is None and fast.few_rows_cap == ALL_ROWS
    x = torch.randn(rows, 64).bfloat16()
    with torch.inference_mode():
        expected = F.linear(x.float(), linear.weight.float(), linear.bias.float())
        torch.testing.assert_close(fast(x).float(), expected, atol=1e-2, rtol=2**-7)
        torch.testing.assert_close(fast(x.view(rows, 1, 64)).float(), expected.view(rows, 1, 96), atol=1e-2,
                                   rtol=2**-7)  # a 3-D input comes back in its own shape


def test_a_cpu_linear_keeps_some_weight() -> None:
    with pytest.raises(ValueError, match="packed weight, the plain one, or both"):
        CpuLinear(nn.Linear(8, 8), packed=False, plain=False)


def test_a_layer_neither_kernel_takes_uses_f_linear() -> None:
    linear = nn.Linear(12, 8).double().eval()  # float64: neither the panel nor the skinny kernel
    fast = CpuLinear(linear, packed=False, plain=True)
    assert not fast.skinny and fast.panels is None
    x = torch.randn(3, 12, dtype=torch.float64)
    with torch.inference_mode():
        torch.testing.assert_close(fast(x), linear(x))


def test_float32_input_sizes_the_skinny_kernel_cannot_take_go_to_the_panel_kernel() -> None:
    linear = nn.Linear(12, 8).eval()  # 12 inputs: not a multiple of 8, which the panel kernel does not need
    fast = CpuLinear(linear, packed=False, plain=True)
    assert fast.skinny and fast.panels is not None
    x = torch.randn(3, 12)
    with torch.inference_mode():
        torch.testing.assert_close(fast(x), linear(x), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("packed", [True, False])
def test_float32_panels_take_the_place_of_the_plain_weight(packed: bool) -> None:
    """The panels replace the plain copy (no third copy beside oneDNN's); they take any number of rows,
    so without oneDNN's copy they serve every call."""
    linear = nn.Linear(64, 48).eval()
    fast = CpuLinear(linear, packed=packed, plain=True)
    assert fast.panels is not None and fast.weight is None and (fast.packed_weight is not None) == packed
    assert fast.skinny_max_rows == ALL_ROWS and "panels all rows" in repr(fast)
    x = torch.randn(300, 64)
    with torch.inference_mode():
        torch.testing.assert_close(fast(x), linear(x), atol=2e-5, rtol=1e-5)


def test_cpu_linears_swaps_nested_layers_and_keeps_the_rest() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4, bias=False)))
    x = torch.randn(5, 8)
    with torch.inference_mode():
        before = model(x)
    assert cpu_linears(model, torch.device("cpu"), torch.float32) == 2
    assert isinstance(model[0], CpuLinear) and isinstance(model[2][0], CpuLinear)
    assert model[0].skinny and model[0].panels is not None  # float32: oneDNN's copy too, unless the panels won all
    assert isinstance(model[1], nn.ReLU)
    with torch.inference_mode():
        torch.testing.assert_close(model(x), before, atol=1e-5, rtol=1e-5)


def test_packing_is_refused_with_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    assert packing_problem(torch.device("cpu"), torch.float32) is None
    assert "not the CPU" in (packing_problem(torch.device("meta"), torch.float32) or "")
    assert "float16" in (packing_problem(torch.device("cpu"), torch.float16) or "")
    monkeypatch.setenv(PACKED_LINEAR_ENV, "0")
    monkeypatch.setenv(SKINNY_LINEAR_ENV, "0")
    model = nn.Sequential(nn.Linear(8, 8))
    assert cpu_linears(model, torch.device("cpu"), torch.float32) == 0
    assert isinstance(model[0], nn.Linear)


def test_packing_off_keeps_the_skinny_path_on_the_plain_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PACKED_LINEAR_ENV, "0")
    model = nn.Sequential(nn.Linear(8, 8))
    assert cpu_linears(model, torch.device("cpu"), torch.float32) == 1
    assert model[0].packed_weight is None and model[0].skinny


def test_the_skinny_path_is_refused_with_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    gib = 2**30
    assert skinny_problem(cpu, torch.float32, gib, packed=True, memory_bytes=16 * gib) is None
    assert "neither float32 nor bfloat16" in (skinny_problem(cpu, torch.float16, gib, packed=True) or "")
    bf16 = skinny_problem(cpu, torch.bfloat16, gib, packed=True, memory_bytes=16 * gib)
    assert bf16 is None if BF16_ROWS else "AVX512-BF16" in (bf16 or "")
    assert "not the CPU" in (skinny_problem(torch.device("meta"), torch.float32, gib, packed=True) or "")
    too_big = skinny_problem(cpu, torch.float32, 5 * gib, packed=True, memory_bytes=16 * gib)
    assert too_big is not None and "25%" in too_big and f"{SKINNY_LINEAR_ENV}=1" in too_big
    assert skinny_problem(cpu, torch.float32, 5 * gib, packed=False, memory_bytes=16 * gib) is None  # no 2nd copy
    monkeypatch.setenv(SKINNY_LINEAR_ENV, "1")
    assert skinny_problem(cpu, torch.float32, 5 * gib, packed=True, memory_bytes=16 * gib) is None
    monkeypatch.setenv(SKINNY_LINEAR_ENV, "0")
    assert skinny_problem(cpu, torch.float32, gib, packed=True) == f"{SKINNY_LINEAR_ENV}=0"
    monkeypatch.setenv(SKINNY_LINEAR_ENV, "yes")
    with pytest.raises(ValueError, match=f"{SKINNY_LINEAR_ENV} must be auto, 0 or 1"):
        plan_linears(nn.Linear(8, 8), cpu, torch.float32)


def test_the_crossover_is_the_cut_whose_kernel_wins_outweigh_its_losses_the_most() -> None:
    def crossover(skinny_ms: list[float], packed_ms: list[float]) -> int:
        return RowsCalibration((1, 2, 4, 8, 16), tuple(skinny_ms), tuple(packed_ms)).max_rows

    assert crossover([1, 1, 1, 1, 1], [2, 2, 2, 2, 2]) == 16
    assert crossover([1, 1, 1, 3, 3], [2, 2, 2, 2, 2]) == 4  # losses from 8 rows on end the kernel's rows
    assert crossover([1, 1, 2.2, 1, 1], [2, 2, 2, 2, 2]) == 16  # one small loss between wins does not
    assert crossover([1, 1, 10, 1, 1], [2, 2, 2, 2, 2]) == 2  # a loss larger than the wins after it does
    assert crossover([2, 2, 2, 2, 2], [2, 2, 2, 2, 2]) == 0  # a tie is not a win
    assert crossover([3, 1, 1, 1, 1], [2, 2, 2, 2, 2]) == 16  # nor does a loss at one row outweigh four wins
    # the Xeon AMX start-up that sent 13-32 rows to oneDNN under the former rule (an unbroken run of wins)
    amx = RowsCalibration((1, 2, 4, 8, 12, 16, 24, 32), (13.2, 12.3, 12.9, 13.2, 8.7, 12.5, 13.9, 19.2),
                          (20.0, 19.9, 19.7, 20.2, 11.7, 11.7, 24.9, 28.4))
    assert amx.max_rows == 32
    level = RowsCalibration((1, 2, 4), (1.0, 2.08, 2.2), (2.0, 2.0, 2.0))
    assert level.max_rows == 1 and level.max_rows_within(1.05) == 2  # within 5 %: a win for the panels
    assert "4 rows 3.0 vs 2.0 ms" in RowsCalibration((4,), (3e-3,), (2e-3,)).describe()


def test_calibration_times_both_routes_on_every_layer_and_row_count() -> None:
    layers = [CpuLinear(nn.Linear(64, 32).eval(), packed=True, plain=True),
              CpuLinear(nn.Linear(32, 48).eval(), packed=True, plain=True)]
    calls: list[tuple[str, int, int]] = []
    for layer in layers:  # record each route's calls through the real routes
        for route in ("plain", "packed"):
            real = getattr(layer, route)
            setattr(layer, route, lambda x, real=real, route=route, layer=layer: (
                calls.append((route, layer.in_features, x.shape[0])), real(x))[1])
    ticks = iter(range(10_000))
    calibration = calibrate_skinny_rows(layers, rows=(1, 4), passes=2, clock=lambda: float(next(ticks)))
    assert calibration.rows == (1, 4) and len(calibration.skinny_s) == len(calibration.packed_s) == 2
    # one untimed and two timed passes per route and row count, each over both layers
    for route in ("plain", "packed"):
        for rows in (1, 4):
            assert sorted(c[1] for c in calls if c[0] == route and c[2] == rows) == [32] * 3 + [64] * 3


def test_calibration_takes_each_routes_fastest_pass() -> None:
    """Interference only adds time, so a slow pass of one route (here 9 s) does not decide."""
    layer = CpuLinear(nn.Linear(64, 32).eval(), packed=True, plain=True)
    durations = [0, 0, 5, 2, 1, 2, 9, 2]  # untimed plain, packed; then plain, packed three times
    stamps = iter([t for d in durations for t in (0.0, float(d))])
    calibration = calibrate_skinny_rows([layer], rows=(1,), passes=3, clock=lambda: next(stamps))
    assert calibration.skinny_s == (1.0,) and calibration.packed_s == (2.0,) and calibration.max_rows == 1


def test_calibration_routes_through_the_real_kernels() -> None:
    layer = CpuLinear(nn.Linear(64, 32).eval(), packed=True, plain=True)
    calibration = calibrate_skinny_rows([layer], rows=(1, 2), passes=1)
    assert all(t > 0 for t in (*calibration.skinny_s, *calibration.packed_s))


def test_calibration_reads_a_bounded_share_of_the_weights() -> None:
    layers = [CpuLinear(nn.Linear(64, 64).eval(), packed=True, plain=True) for _ in range(4)]  # 16 KiB each
    assert calibration_layers(layers, budget=40 << 10) == layers[:2]
    assert calibration_layers(layers, budget=1) == layers[:1]  # at least one
    assert calibration_layers(layers, budget=1 << 30) == layers


def test_cpu_linears_routes_by_the_measured_or_configured_row_limit(monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(SKINNY_ROWS_ENV, "3")
    model = nn.Sequential(nn.Linear(16, 8))
    x = torch.randn(4, 16)
    with torch.inference_mode():
        want = model(x)
    assert cpu_linears(model, torch.device("cpu"), torch.float32) == 1
    layer = model[0]
    assert layer.skinny_max_rows == 3 and "panels <=3 rows" in repr(layer)  # float32: the panel kernel
    used: list[int] = []
    real = panel.panel_linear
    monkeypatch.setattr(panel, "panel_linear", lambda x, w: (used.append(x.shape[0]), real(x, w))[1])
    with torch.inference_mode():
        torch.testing.assert_close(layer(x[:3]), want[:3], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(layer(x), want, atol=1e-5, rtol=1e-5)
    assert used == [3]  # 3 rows took the kernel, 4 took oneDNN

    monkeypatch.delenv(SKINNY_ROWS_ENV)
    measured = nn.Sequential(nn.Linear(16, 8))
    with caplog.at_level("INFO", logger="chariot.worker.model.cpu_linear"):
        cpu_linears(measured, torch.device("cpu"), torch.float32)
    limit = measured[0].skinny_max_rows
    assert limit in (0, *ROW_CANDIDATES, ALL_ROWS)
    assert (measured[0].packed_weight is None) == (limit == ALL_ROWS)  # oneDNN's copy goes when unused
    line = next(r.getMessage() for r in caplog.records if "panel kernel for" in r.getMessage())
    assert all(f"{m} rows " in line for m in ROW_CANDIDATES)
    assert ("every row count" in line) if limit == ALL_ROWS else (f"up to {limit} rows" in line)


AVX2_FLAGS = frozenset({"avx2", "fma"})
AVX512_FLAGS = AVX2_FLAGS | {"avx512f"}


@pytest.mark.parametrize(("flags", "lost_from", "many_rows_s", "limit"),
                         [(AVX2_FLAGS, None, 1.0, ALL_ROWS), (AVX2_FLAGS, None, 1.6, ALL_ROWS),
                          (AVX2_FLAGS, None, 1.7, 64), (AVX2_FLAGS, 64, 1.0, ALL_ROWS), (AVX2_FLAGS, 48, 1.7, 32),
                          (AVX2_FLAGS, 32, 1.0, 24), (AVX512_FLAGS, None, 1.55, ALL_ROWS),
                          (AVX512_FLAGS, None, 1.6, 64), (AVX512_FLAGS, 48, 1.6, 32)])
def test_the_panel_kernel_takes_every_row_count_when_it_is_level_at_prefill_size(
        monkeypatch: pytest.MonkeyPatch, flags: frozenset[str], lost_from: int | None, many_rows_s: float,
        limit: int) -> None:
    """Timings and CPU flags faked (the decision, not the machine, is under test), oneDNN at 1.5 s
    everywhere: the panel kernel wins a decode row count unless oneDNN is more than 5 % faster (1.6 s
    loses; it loses every count from `lost_from` on), and MANY_ROWS unless oneDNN is more than 10 %
    faster on a CPU without AVX-512 (1.6 s wins, 1.7 s loses), more than 5 % with it (1.55 s wins,
    1.6 s loses). When its decode cut reaches SETTLED_ROWS, MANY_ROWS decides between every row count
    (oneDNN's copy released) and the decode limit, even after a loss at 48 or 64 rows; a loss at 32
    rows stops there without timing MANY_ROWS."""
    monkeypatch.setattr(cpu_linear, "cpu_flags", lambda: flags)
    timed: list[tuple[int, ...]] = []
    many_rows_win = limit == ALL_ROWS

    def fake(layers: object, rows: list[int], **_: object) -> RowsCalibration:
        timed.append(tuple(rows))
        kernel = [many_rows_s if r == MANY_ROWS else 1.6 if lost_from is not None and r >= lost_from else 1.0
                  for r in rows]
        return RowsCalibration(tuple(rows), tuple(kernel), (1.5,) * len(rows))

    monkeypatch.setattr(cpu_linear, "calibrate_skinny_rows", fake)
    model = nn.Sequential(nn.Linear(16, 8))
    x = torch.randn(MANY_ROWS, 16)
    with torch.inference_mode():
        want = model(x)
    cpu_linears(model, torch.device("cpu"), torch.float32)
    assert timed == ([ROW_CANDIDATES] if lost_from == SETTLED_ROWS else [ROW_CANDIDATES, (MANY_ROWS,)])
    assert model[0].skinny_max_rows == limit and (model[0].packed_weight is None) == many_rows_win
    with torch.inference_mode():
        torch.testing.assert_close(model(x), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("value", "panel_rows", "packed_kept"), [("48", 48, True), ("all", ALL_ROWS, False)])
def test_a_configured_limit_is_capped_by_each_layers_kernel(monkeypatch: pytest.MonkeyPatch, value: str,
                                                           panel_rows: int, packed_kept: bool) -> None:
    """The panel kernel takes any number of rows (with `all`, every call: oneDNN's copy is released),
    the skinny kernel (here: panels turned off) up to 32."""
    monkeypatch.setenv(SKINNY_ROWS_ENV, value)
    base = nn.Linear(16, 8).eval()
    x = torch.randn(40, 16)
    with torch.inference_mode():
        want = base(x)
    panels, plain = nn.Sequential(copy.deepcopy(base)), nn.Sequential(copy.deepcopy(base))
    cpu_linears(panels, torch.device("cpu"), torch.float32)
    monkeypatch.setenv(PANEL_LINEAR_ENV, "0")
    cpu_linears(plain, torch.device("cpu"), torch.float32)
    assert panels[0].panels is not None and panels[0].skinny_max_rows == panel_rows
    assert (panels[0].packed_weight is not None) == packed_kept
    assert plain[0].panels is None and plain[0].weight is not None and plain[0].skinny_max_rows == skinny.MAX_ROWS
    with torch.inference_mode():
        for layer in (panels[0], plain[0]):
            torch.testing.assert_close(layer(x), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("value", ["-1", "many", "2.5", "ALL"])
def test_a_bad_row_limit_names_the_variable_and_range(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(SKINNY_ROWS_ENV, value)
    with pytest.raises(ValueError, match=rf"{SKINNY_ROWS_ENV} must be a row count \(an integer >= 0\) or 'all'"):
        configured_skinny_rows()


PACKS_BF16 = packing_problem(torch.device("cpu"), torch.bfloat16) is None  # oneDNN packs bf16 on this CPU


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 40, 300])
def test_a_bf16_layer_packed_in_float32_computes_in_float32(bias: bool, rows: int) -> None:
    """The upcast route: a bf16 layer whose oneDNN copy is float32 gives float32 arithmetic on the bf16
    values (exact inputs, float32 sums), rounded to bf16 once; a float32 copy packs on every CPU."""
    torch.manual_seed(rows)
    linear = nn.Linear(256, 384, bias=bias).to(torch.bfloat16).eval()
    fast = CpuLinear(linear, packed=True, plain=False, packed_dtype=torch.float32)
    assert fast.compute_dtype == torch.float32 and fast.packed_weight is not None and not fast.skinny
    assert "packed=oneDNN float32" in repr(fast)
    x = torch.randn(rows, 256).bfloat16()
    bias_f32 = None if linear.bias is None else linear.bias.float()
    want = F.linear(x.float(), linear.weight.float(), bias_f32)
    with torch.inference_mode():
        ours = fast(x)
        assert ours.dtype == torch.bfloat16
        torch.testing.assert_close(ours.float(), want, atol=1e-2, rtol=2**-8)  # one bf16 rounding
        torch.testing.assert_close(fast(x.view(rows, 1, 256)), ours.view(rows, 1, 384))


def test_only_a_bf16_layer_takes_a_float32_packed_copy() -> None:
    with pytest.raises(ValueError, match="only a bfloat16 weight takes a float32 packed copy"):
        CpuLinear(nn.Linear(8, 8), packed=True, plain=False, packed_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"packed_dtype torch\.float64"):
        CpuLinear(nn.Linear(8, 8).bfloat16(), packed=True, plain=False, packed_dtype=torch.float64)
    same = CpuLinear(nn.Linear(8, 8), packed=True, plain=False, packed_dtype=torch.float32)  # its own dtype
    assert same.compute_dtype == torch.float32 and "float32" not in repr(same).split("packed=oneDNN")[1]


def test_the_float32_copy_is_refused_with_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    gib = 2**30
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert upcast_problem(torch.bfloat16, gib, packed=True, memory_bytes=16 * gib) is None
    assert "not bfloat16" in (upcast_problem(torch.float32, gib, packed=True, memory_bytes=16 * gib) or "")
    assert "not packed" in (upcast_problem(torch.bfloat16, gib, packed=False, memory_bytes=16 * gib) or "")
    too_big = upcast_problem(torch.bfloat16, 3 * gib, packed=True, memory_bytes=16 * gib)  # 6 GiB > 4 GiB
    assert too_big is not None and "6.0 GiB" in too_big and "25%" in too_big and f"{UPCAST_ENV}=1" in too_big
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert "AMX" in (upcast_problem(torch.bfloat16, gib, packed=True, memory_bytes=16 * gib) or "")
    monkeypatch.setenv(UPCAST_ENV, "1")  # forced: neither memory nor AMX refuses it; the dtype still does
    assert upcast_problem(torch.bfloat16, 3 * gib, packed=True, memory_bytes=16 * gib) is None
    assert upcast_problem(torch.float32, gib, packed=True) is not None
    monkeypatch.setenv(UPCAST_ENV, "0")
    assert upcast_problem(torch.bfloat16, gib, packed=True) == f"{UPCAST_ENV}=0"
    monkeypatch.setenv(UPCAST_ENV, "on")
    with pytest.raises(ValueError, match=f"{UPCAST_ENV} must be auto, 0 or 1"):
        upcast_problem(torch.bfloat16, gib, packed=True)


@pytest.mark.parametrize(("bf16_s", "float32_s", "chosen"),
                         [(1.5, 1.0, torch.float32), (1.12, 1.0, torch.float32), (1.08, 1.0, None), (0.5, 1.0, None)])
def test_the_float32_copy_is_kept_when_it_wins_by_more_than_the_tie(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, bf16_s: float, float32_s: float,
        chosen: torch.dtype | None) -> None:
    """Timings faked (the decision is under test): float32 is kept only when more than 10 % faster,
    timed on the leading layers only; `1` keeps it without timing, `0` neither times nor keeps it."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    timed: list[list[nn.Linear]] = []

    def fake(linears: list[nn.Linear], **_: object) -> UpcastCalibration:
        timed.append(list(linears))
        return UpcastCalibration(MANY_ROWS, bf16_s, float32_s)

    monkeypatch.setattr(cpu_linear, "calibrate_upcast", fake)
    big = [nn.Linear(4096, 4096, bias=False, device="meta", dtype=torch.bfloat16) for _ in range(3)]  # 32 MiB each
    with caplog.at_level("INFO", logger="chariot.worker.model.cpu_linear"):
        assert cpu_linear.packed_dtype(big, torch.bfloat16, packed=True, memory_bytes=2**40) == chosen
    assert timed == [big[:2]]  # the leading 64 MiB
    assert any(f"{MANY_ROWS} rows: float32 {float32_s * 1e3:.1f} vs bf16" in r.getMessage() for r in caplog.records)
    monkeypatch.setenv(UPCAST_ENV, "1")
    assert cpu_linear.packed_dtype(big, torch.bfloat16, packed=True, memory_bytes=2**40) == torch.float32
    monkeypatch.setenv(UPCAST_ENV, "0")
    assert cpu_linear.packed_dtype(big, torch.bfloat16, packed=True, memory_bytes=2**40) is None
    assert len(timed) == 1


def test_upcast_calibration_times_both_routes_through_real_layers() -> None:
    """Where oneDNN packs bf16, both routes run on real layers and are timed; elsewhere the float32
    copy is refused before anything is timed (the layers are not packed)."""
    layers = [nn.Linear(64, 32).bfloat16(), nn.Linear(32, 48).bfloat16()]
    if not PACKS_BF16:
        assert "not packed" in (upcast_problem(torch.bfloat16, 1, packed=PACKS_BF16) or "")
        return
    ticks = iter(range(10_000))
    timed = calibrate_upcast(layers, rows=8, passes=2, clock=lambda: float(next(ticks)))
    assert timed.rows == 8 and timed.bf16_s == timed.float32_s == 1.0  # one tick per pass: every pass timed
    real = calibrate_upcast(layers, rows=8, passes=1)
    assert real.bf16_s > 0 and real.float32_s > 0


def test_cpu_linears_packs_bf16_layers_in_float32_when_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    """`CHARIOT_CPU_BF16_UPCAST=1` on a bf16 model: every layer's oneDNN copy is float32 (where oneDNN
    packs bf16 at all), and the model's output stays that of float32 arithmetic on its bf16 values."""
    monkeypatch.setenv(UPCAST_ENV, "1")
    monkeypatch.setenv(SKINNY_ROWS_ENV, "0")  # every row count takes oneDNN
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 32)).bfloat16().eval()
    x = torch.randn(50, 64).bfloat16()
    with torch.inference_mode():
        hidden = F.relu(F.linear(x.float(), model[0].weight.float(), model[0].bias.float())).bfloat16()
        want = F.linear(hidden.float(), model[2].weight.float(), model[2].bias.float())
    assert cpu_linears(model, torch.device("cpu"), torch.bfloat16) == 2
    assert all(m.compute_dtype == (torch.float32 if PACKS_BF16 else torch.bfloat16) for m in (model[0], model[2]))
    with torch.inference_mode():
        torch.testing.assert_close(model(x).float(), want, atol=2e-2, rtol=2**-7)
