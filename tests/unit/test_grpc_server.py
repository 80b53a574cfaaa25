"""gRPC server helpers: undecodable request bytes become an `Undecodable` value (answered with
INVALID_ARGUMENT by the servicer guard, see the worker and router integration tests) and junk traffic
logs one line per interval, not a traceback per call; stopping a server is bounded past its grace."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import pytest

from chariot.contracts import grpc_server
from chariot.contracts.grpc_server import OncePerInterval, Undecodable, stop_server, tolerant_decoder
from chariot.proto.chariot.v1 import generation_pb2 as pb


def test_tolerant_decoder_turns_junk_into_undecodable() -> None:
    decode = tolerant_decoder(pb.GenerateRequest)
    valid = pb.GenerateRequest(text="hé").SerializeToString()
    assert decode(valid) == pb.GenerateRequest(text="hé")
    bad_utf8 = decode(valid.replace("é".encode(), b"\xff\xfe"))
    assert isinstance(bad_utf8, Undecodable) and "UTF-8" in bad_utf8.reason
    assert isinstance(decode(b"\xff" * 7), Undecodable)


def test_once_per_interval_logs_one_line_and_counts_the_rest(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    limiter = OncePerInterval(10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="chariot.contracts.grpc_server"):
        assert limiter.warn("junk 1")
        now[0] += 3.0
        assert not limiter.warn("junk 2")
        assert not limiter.warn("junk 3")
        now[0] += 7.5
        assert limiter.warn("junk 4")
    assert [r.getMessage() for r in caplog.records] == ["junk 1", "junk 4 (2 more like it in the last 10s)"]


async def _slow(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    """A handler that outlives the grace (the server's stop cancels it)."""
    await asyncio.sleep(3600)
    return b""


def test_stop_server_ends_a_real_server_with_a_call_in_flight_at_its_grace() -> None:
    async def scenario() -> float:
        server = grpc.aio.server()
        handler = grpc.method_handlers_generic_handler("t.T", {"S": grpc.unary_unary_rpc_method_handler(_slow)})
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/t.T/S")(b"")
            await asyncio.sleep(0.2)  # the call is in the handler
            start = time.monotonic()
            await stop_server(server, 0.2)
            took = time.monotonic() - start
            with pytest.raises(grpc.aio.AioRpcError):
                await call
        return took

    assert asyncio.run(scenario()) < grpc_server.STOP_MARGIN_S


class _NeverStops:
    """Stands in for a grpc.aio.Server whose shutdown never completes: grpc's occasional hang cannot be
    produced on demand, so this server's `stop` simply never returns."""

    async def stop(self, grace: float | None) -> None:
        await asyncio.Event().wait()


def test_stop_server_gives_up_on_a_stop_that_never_completes(monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(grpc_server, "STOP_MARGIN_S", 0.3)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="chariot.contracts.grpc_server"):
        asyncio.run(stop_server(_NeverStops(), 0.2))  # type: ignore[arg-type]
    assert 0.5 <= time.monotonic() - start < 5
    assert "had not stopped" in caplog.text
