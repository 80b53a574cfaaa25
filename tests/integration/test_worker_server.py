"""The worker gRPC server end to end: a real `grpc.aio` server on an ephemeral port, real clients
(the generated stubs), a real tiny checkpoint on CPU.

Covers: greedy parity with the offline `LLM` API, interleaving of concurrent requests, cancellation
freeing KV blocks (seen through the Stats RPC), INVALID_ARGUMENT naming the field for bad input while
good requests keep working, health and reflection, a hypothesis fuzz of `GenerateRequest`, engine
failure → non-zero exit, and SIGTERM → exit 0.

The tiny model steps in about a millisecond, faster than a client reads a stream; the served engine
is paced (`PACE_S` per step, like a bigger model) so that "mid-stream" is a real window.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chariot.contracts.errors import ConfigError, ModelLoadError, PipelineError
from chariot.contracts.grpc_server import SERVICE_NAME
from chariot.contracts.proto_codec import request_to_proto
from chariot.proto.chariot.v1 import generation_pb2 as pb
from chariot.proto.chariot.v1 import generation_pb2_grpc as pb_grpc
from chariot.worker import LLM, SamplingParams
from chariot.worker.config import EngineConfig
from chariot.worker.engine import Engine
from chariot.worker.engine_output import StepResult
from chariot.worker.server import EXIT_ENGINE_FAILED, EXIT_OK, serve

SERVED = "tiny"
MAX_MODEL_LEN = 256
ENGINE_KW: dict[str, Any] = {"dtype": "float32", "kv_cache_tokens": 2048, "max_model_len": MAX_MODEL_LEN,
                             "block_size": 16}  # the small caches here are sized in 16-token blocks
PACE_S = 0.003
TIMEOUT = 60.0
GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


class PacedEngine(Engine):
    """The real engine, with a minimum wall time per step (see module docstring)."""

    pace_s = PACE_S

    def step(self) -> StepResult:
        outputs = super().step()
        time.sleep(self.pace_s)
        return outputs


class FailingExecutor:
    """Wraps the engine's executor; from the `fail_after`-th batch on, the pipeline is 'broken'."""

    def __init__(self, inner: Any, fail_after: int) -> None:
        self._inner = inner
        self._left = fail_after
        self.failed: str | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def wait(self) -> Any:
        self._left -= 1
        if self._left < 0:
            self.failed = "stage 1 stopped answering"
            raise PipelineError(self.failed)
        return self._inner.wait()


def paced_factory(model_dir: Path) -> Callable[[], Engine]:
    """Picklable, so that the engine-core process can build the engine itself."""
    return functools.partial(PacedEngine, EngineConfig(model=str(model_dir), **ENGINE_KW), progress=False)


class RunningServer:
    """`serve()` on its own thread and event loop, port 0; stopped through `serve(stop=...)`."""

    def __init__(self, factory: Callable[[], Engine], served_model: str = SERVED, engine_core: str = "thread") -> None:
        self.port = 0
        self.engine_core = engine_core
        self.exit_code: int | None = None
        self.error: BaseException | None = None
        self._factory, self._model = factory, served_model
        self._listening = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self.thread = threading.Thread(target=self._main, daemon=True)
        self.thread.start()
        assert self._listening.wait(TIMEOUT), "server did not start"
        if self.error is not None and self.port == 0:  # failed before listening (a later failure, e.g.
            raise self.error  # the engine's load, is the test's to inspect through wait_exit/error)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self.exit_code = self._loop.run_until_complete(self._serve())
        except BaseException as exc:
            self.error = exc
        finally:
            self._listening.set()
            self._loop.close()

    async def _serve(self) -> int:
        self._stop = asyncio.Event()
        return await serve(
            self._factory, "127.0.0.1", 0, self._model, ready=self._on_ready, stop=self._stop, grace_s=1.0,
            engine_core=self.engine_core,
        )

    def _on_ready(self, port: int) -> None:
        self.port = port
        self._listening.set()

    def wait_serving(self) -> None:
        wait_for(lambda: health_status(self.health, "") == health_pb2.HealthCheckResponse.SERVING)

    def stats(self) -> Any:
        return self.stub.Stats(pb.StatsRequest(), timeout=TIMEOUT)

    def wait_exit(self) -> int | None:
        self.thread.join(TIMEOUT)
        assert not self.thread.is_alive(), "serve() did not return"
        self.channel.close()
        return self.exit_code

    def stop(self) -> int | None:
        assert self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        return self.wait_exit()


def wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def health_status(stub: Any, service: str) -> int:
    try:
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
    except grpc.RpcError:
        return -1


def collect(stub: Any, req: Any) -> list[Any]:
    return list(stub.Generate(req, timeout=TIMEOUT))


def joined(responses: list[Any]) -> tuple[list[int], str]:
    return [t for r in responses for t in r.token_ids], "".join(r.text for r in responses)


@pytest.fixture(scope="module", params=["thread", "process"])
def server(tiny_model_dir: Path, request: pytest.FixtureRequest) -> Any:
    """Every server test runs against both engine fronts: the engine thread and the engine-core process."""
    srv = RunningServer(paced_factory(tiny_model_dir), engine_core=request.param)
    srv.wait_serving()
    yield srv
    assert srv.stop() == EXIT_OK


@pytest.fixture(scope="module")
def offline(tiny_model_dir: Path) -> LLM:
    return LLM(model=str(tiny_model_dir), progress=False, **ENGINE_KW)


@pytest.fixture(scope="module")
def vocab(tiny_model_dir: Path) -> int:
    return int(json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"])


def assert_idle(srv: RunningServer) -> None:
    """No live requests and every KV block free (shortly after the last call ended)."""

    def idle() -> bool:
        s = srv.stats()
        return s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_blocks

    wait_for(idle)


# ---- health, reflection, stats -----------------------------------------------------------------
def test_health_reports_serving(server: RunningServer) -> None:
    serving = health_pb2.HealthCheckResponse.SERVING
    assert health_status(server.health, "") == serving
    assert health_status(server.health, SERVICE_NAME) == serving
    with pytest.raises(grpc.RpcError) as err:
        server.health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_services(server: RunningServer) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(server.channel)
    requests = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE_NAME),
    ]
    listed, files = list(stub.ServerReflectionInfo(iter(requests), timeout=TIMEOUT))
    names = {s.name for s in listed.list_services_response.service}
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names
    assert files.file_descriptor_response.file_descriptor_proto  # the .proto is served too


def test_stats_reports_engine_shape(server: RunningServer) -> None:
    s = server.stats()
    assert (s.model, s.max_model_len, s.pipeline_stages) == (SERVED, MAX_MODEL_LEN, 1)
    assert s.num_blocks == 2048 // 16 and s.token_budget > 0 and s.max_batch_size == 128


# ---- generation --------------------------------------------------------------------------------
def test_stream_matches_offline_greedy(server: RunningServer, offline: LLM, vocab: int) -> None:
    prompts: list[str | list[int]] = ["The quick brown fox", [(7 * i) % vocab for i in range(1, 40)]]
    expected = offline.generate(prompts, GREEDY)
    for prompt, ref in zip(prompts, expected, strict=True):
        responses = collect(server.stub, request_to_proto(prompt, GREEDY, model=SERVED))
        assert joined(responses) == (ref.token_ids, ref.text)
        assert all(len(r.token_ids) == 1 for r in responses)  # one response per engine output
        last = responses[-1]
        assert (
            last.finish_reason
            == {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}[ref.finish_reason.value]
        )
        assert (last.prompt_tokens, last.completion_tokens) == (len(ref.prompt_token_ids), len(ref.token_ids))
        assert 0 < last.timing.arrival <= last.timing.first_token <= last.timing.last_token
    stats = server.stats()
    assert stats.prefill_tokens_per_s > 0
    assert stats.budget_tokens_per_s > 0, "steps of several batch sizes: the step-cost line is fitted"


def test_concurrent_requests_interleave(server: RunningServer, offline: LLM) -> None:
    long_p = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    short_p = SamplingParams(max_tokens=15, temperature=0.0, ignore_eos=True)
    ref_long, ref_short = offline.generate(["Once upon a time", "Hello world"], [long_p, short_p])
    arrivals: list[tuple[str, float]] = []
    results: dict[str, list[Any]] = {}
    first_a = threading.Event()

    def run(name: str, req: Any) -> None:
        results[name] = []
        for r in server.stub.Generate(req, timeout=TIMEOUT):
            arrivals.append((name, time.monotonic()))
            results[name].append(r)
            first_a.set()

    a = threading.Thread(target=run, args=("a", request_to_proto("Once upon a time", long_p)))
    a.start()
    assert first_a.wait(TIMEOUT)
    run("b", request_to_proto("Hello world", short_p))
    a.join(TIMEOUT)

    assert joined(results["a"])[0] == ref_long.token_ids
    assert joined(results["b"])[0] == ref_short.token_ids
    order = [name for name, _ in arrivals]
    last_b = len(order) - 1 - order[::-1].index("b")
    assert "a" in order[last_b:], "b (arrived second, shorter) finished before a"
    # While both ran, a kept streaming: a's responses are interleaved with b's, not queued behind.
    first_b = order.index("b")
    assert order[first_b:last_b].count("a") >= short_p.max_tokens // 2
    produced_a = [r.timing.last_token for r in results["a"]]
    produced_b = [r.timing.last_token for r in results["b"]]
    assert sum(produced_b[0] <= t <= produced_b[-1] for t in produced_a) >= short_p.max_tokens // 2


def test_cancel_frees_kv_blocks(server: RunningServer) -> None:
    params = SamplingParams(max_tokens=MAX_MODEL_LEN - 40, temperature=0.0, ignore_eos=True)
    iterations_before = server.stats().iterations
    call = server.stub.Generate(request_to_proto(list(range(3, 40)), params), timeout=TIMEOUT)
    for _, _ in zip(range(3), call, strict=False):
        pass
    busy = server.stats()
    assert busy.num_running == 1 and busy.num_free_blocks < busy.num_blocks
    call.cancel()
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    assert_idle(server)
    # Aborted, not run to completion.
    assert server.stats().iterations - iterations_before < params.max_tokens // 2


def test_abandoned_stream_is_aborted(server: RunningServer) -> None:
    """A client that goes away (channel closed) also frees the request's blocks."""
    params = SamplingParams(max_tokens=MAX_MODEL_LEN - 20, temperature=0.0, ignore_eos=True)
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = pb_grpc.GenerationStub(channel).Generate(request_to_proto("abandon me", params), timeout=TIMEOUT)
        next(call)
    assert_idle(server)


# ---- bad input ---------------------------------------------------------------------------------
def _req(**kw: Any) -> Any:
    sampling = kw.pop("sampling", {})
    req = pb.GenerateRequest(sampling=pb.SamplingParams(**sampling), **kw)
    if "text" not in kw and "token_ids" not in kw and not kw.pop("no_prompt", False):
        req.text = "hello"
    return req


def bad_requests(vocab: int) -> list[tuple[str, Any, str]]:
    return [
        ("empty text", _req(text=""), "prompt"),
        ("no prompt", pb.GenerateRequest(), "prompt"),
        ("empty token ids", _req(token_ids=pb.TokenIds(ids=[])), "prompt"),
        ("prompt too long", _req(token_ids=pb.TokenIds(ids=[5] * (MAX_MODEL_LEN + 1))), "prompt"),
        ("token id >= vocab", _req(token_ids=pb.TokenIds(ids=[1, vocab])), "prompt"),
        ("negative token id", _req(token_ids=pb.TokenIds(ids=[-1])), "prompt"),
        ("max_tokens 0", _req(sampling={"max_tokens": 0}), "max_tokens"),
        ("max_tokens negative", _req(sampling={"max_tokens": -3}), "max_tokens"),
        ("max_tokens > model len", _req(sampling={"max_tokens": MAX_MODEL_LEN}), "max_tokens"),
        ("max_tokens huge", _req(sampling={"max_tokens": 2**62}), "max_tokens"),
        ("temperature < 0", _req(sampling={"temperature": -0.5}), "temperature"),
        ("temperature nan", _req(sampling={"temperature": math.nan}), "temperature"),
        ("top_p 0", _req(sampling={"top_p": 0.0}), "top_p"),
        ("top_p > 1", _req(sampling={"top_p": 1.5}), "top_p"),
        ("top_k < 0", _req(sampling={"top_k": -1}), "top_k"),
        ("seed < 0", _req(sampling={"seed": -1}), "seed"),
        ("empty stop string", _req(sampling={"stop": ["ok", ""]}), "stop"),
        ("negative stop token", _req(sampling={"stop_token_ids": [-2]}), "stop_token_ids"),
        ("stop token out of vocabulary", _req(sampling={"stop_token_ids": [vocab]}), "stop_token_ids"),
        ("unknown model", _req(model="llama-9000"), "model"),
        ("request id too long", _req(request_id="x" * 1000), "request_id"),
    ]


def undecodable_requests() -> list[bytes]:
    """Bytes that are no GenerateRequest: invalid UTF-8 in a string field, a truncated field."""
    valid = pb.GenerateRequest(text="hé").SerializeToString()
    return [valid.replace("é".encode(), b"\xff\xfe"), valid[:-1], b"\xff" * 7]


def test_bad_input_is_invalid_argument_and_good_request_completes(
    server: RunningServer, offline: LLM, vocab: int
) -> None:
    good_params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)  # ≥ 0.6 s at PACE_S
    ref = offline.generate(["a good request"], good_params)[0]
    good: list[Any] = []
    started = threading.Event()

    def run_good() -> None:
        for r in server.stub.Generate(
            request_to_proto("a good request", good_params, request_id="good-1"), timeout=TIMEOUT
        ):
            good.append(r)
            started.set()

    thread = threading.Thread(target=run_good)
    thread.start()
    assert started.wait(TIMEOUT)
    cases = [*bad_requests(vocab), ("duplicate live request id", _req(request_id="good-1"), "request_id")]
    for name, req, field in cases:
        with pytest.raises(grpc.RpcError) as err:
            collect(server.stub, req)
        expected = grpc.StatusCode.NOT_FOUND if field == "model" else grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.code() == expected, name
        assert err.value.details().startswith(f"{field}:"), (name, err.value.details())
    for junk in undecodable_requests():
        with pytest.raises(grpc.RpcError) as err:
            list(server.channel.unary_stream("/chariot.v1.Generation/Generate")(junk, timeout=TIMEOUT))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, junk
        assert err.value.details().startswith("request: cannot be decoded"), err.value.details()
    assert thread.is_alive(), "the good request should still be streaming while the bad ones are rejected"
    thread.join(TIMEOUT)
    assert joined(good) == (ref.token_ids, ref.text)
    assert good[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert_idle(server)


# ---- fuzz --------------------------------------------------------------------------------------
INT64 = st.integers(-(2**63), 2**63 - 1)
SMALL_INT = st.integers(-3, MAX_MODEL_LEN + 3)
ANY_FLOAT = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, -0.0, 0.5, 1.0, 1e-9])
WILD_ODDS = 8  # each field is drawn from its wild strategy about once in this many requests


def _mostly(draw: st.DrawFn, usual: st.SearchStrategy[Any], wild: st.SearchStrategy[Any]) -> Any:
    """Usually a plausible value, sometimes anything the wire type allows (so ~1/3 of requests are valid)."""
    return draw(wild) if draw(st.integers(0, WILD_ODDS - 1)) == 0 else draw(usual)


@st.composite
def fuzz_requests(draw: st.DrawFn, vocab: int) -> Any:
    token = st.integers(0, vocab - 1)
    req = pb.GenerateRequest(
        request_id=_mostly(draw, st.just("") | st.text(max_size=12), st.text(min_size=250, max_size=300)),
        model=_mostly(draw, st.sampled_from(["", SERVED]), st.text(max_size=10)),
        tenant=draw(st.text(max_size=10)),
    )
    prompt = _mostly(
        draw,
        st.text(min_size=1, max_size=100) | st.lists(token, min_size=1, max_size=100),
        st.none() | st.text(max_size=400) | st.lists(token | INT64, max_size=300),
    )
    if isinstance(prompt, str):
        req.text = prompt
    elif prompt is not None:
        req.token_ids.ids.extend(prompt)
    if draw(st.booleans()):
        fill_sampling(draw, req.sampling, token)
    return req


def fill_sampling(draw: st.DrawFn, s: Any, token: st.SearchStrategy[int]) -> None:
    for name, usual, wild in (
        ("max_tokens", st.integers(1, 40), SMALL_INT | INT64),
        ("temperature", st.floats(0.0, 2.0), ANY_FLOAT),
        ("top_p", st.floats(0.05, 1.0), ANY_FLOAT),
        ("top_k", st.integers(0, 50), SMALL_INT | INT64),
        ("seed", st.integers(0, 2**63 - 1), INT64),
    ):
        if draw(st.booleans()):  # else left unset: the server default applies
            setattr(s, name, _mostly(draw, usual, wild))
    s.stop.extend(
        _mostly(draw, st.lists(st.text(min_size=1, max_size=4), max_size=2), st.lists(st.text(max_size=4), max_size=3))
    )
    s.stop_token_ids.extend(_mostly(draw, st.lists(token, max_size=2), st.lists(INT64, max_size=3)))
    s.ignore_eos = draw(st.booleans())


def test_fuzz_requests_end_ok_or_invalid_argument(server: RunningServer, vocab: int) -> None:
    outcomes: Counter[str] = Counter()

    @settings(
        max_examples=60,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(req=fuzz_requests(vocab))
    def check(req: Any) -> None:
        try:
            responses = collect(server.stub, req)
        except grpc.RpcError as err:
            unknown_model = err.details().startswith("model:")
            expected = grpc.StatusCode.NOT_FOUND if unknown_model else grpc.StatusCode.INVALID_ARGUMENT
            assert err.code() == expected, (err.code(), err.details())
            outcomes[err.details().split(":")[0]] += 1
            return
        outcomes["OK"] += 1
        assert responses and responses[-1].finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)

    check()
    assert outcomes["OK"] >= 10, outcomes  # the fuzz also exercises generation, not only rejection
    server.wait_serving()
    assert_idle(server)
    assert collect(server.stub, request_to_proto("still alive", GREEDY))[-1].completion_tokens > 0


# ---- lifetime ----------------------------------------------------------------------------------
def test_engine_failure_fails_requests_and_exits_nonzero(tiny_model_dir: Path) -> None:
    def factory() -> Engine:
        engine = PacedEngine(EngineConfig(model=str(tiny_model_dir), **ENGINE_KW), progress=False)
        engine.executor = FailingExecutor(engine.executor, fail_after=5)
        return engine

    srv = RunningServer(factory)
    srv.wait_serving()
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    responses = collect(srv.stub, request_to_proto("doomed", params))
    assert responses[-1].finish_reason == pb.FINISH_REASON_ERROR
    assert "stage 1 stopped answering" in responses[-1].error
    assert srv.wait_exit() == EXIT_ENGINE_FAILED


class CrashingEngine(PacedEngine):
    """A bug in the engine loop (an exception escapes step())."""

    def step(self) -> StepResult:
        if self.iterations >= 3:
            raise RuntimeError("bug in step")
        return super().step()


def test_engine_crash_is_unavailable_and_exits_nonzero(tiny_model_dir: Path) -> None:
    srv = RunningServer(lambda: CrashingEngine(EngineConfig(model=str(tiny_model_dir), **ENGINE_KW), progress=False))
    srv.wait_serving()
    with pytest.raises(grpc.RpcError) as err:
        collect(srv.stub, request_to_proto("crash", SamplingParams(max_tokens=50, ignore_eos=True)))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "bug in step" in err.value.details()
    assert srv.wait_exit() == EXIT_ENGINE_FAILED


def test_load_failure_is_raised() -> None:
    def factory() -> Engine:
        raise ModelLoadError("no such model")

    srv = RunningServer(factory)  # listening (health NOT_SERVING) while the engine loads
    assert srv.wait_exit() is None
    assert isinstance(srv.error, ModelLoadError)


def test_port_in_use_is_a_config_error(server: RunningServer) -> None:
    def factory() -> Engine:
        raise AssertionError("the engine must not be built when the port cannot be bound")

    async def main() -> int:
        return await serve(factory, "127.0.0.1", server.port, SERVED, engine_core="thread")

    with pytest.raises(ConfigError) as err:
        asyncio.run(main())
    assert err.value.field == "port"


SERVE_SCRIPT = """
import asyncio, sys
from chariot.worker.config import EngineConfig
from chariot.worker.engine import Engine
from chariot.worker.server import serve
cfg = EngineConfig(model=sys.argv[1], dtype="float32", kv_cache_tokens=2048, max_model_len=256)
code = asyncio.run(serve(lambda: Engine(cfg, progress=False), "127.0.0.1", 0, "tiny",
                         ready=lambda port: print(port, flush=True), engine_core="thread"))
sys.exit(code)
"""


def test_sigterm_exits_zero(tiny_model_dir: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE_SCRIPT, str(tiny_model_dir)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            wait_for(lambda: health_status(stub, SERVICE_NAME) == health_pb2.HealthCheckResponse.SERVING, TIMEOUT)
            out = list(pb_grpc.GenerationStub(channel).Generate(request_to_proto("hi", GREEDY), timeout=TIMEOUT))
            assert out[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(TIMEOUT) == EXIT_OK
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
