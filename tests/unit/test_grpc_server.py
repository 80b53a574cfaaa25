"""gRPC server helpers: undecodable request bytes become an `Undecodable` value (answered with
INVALID_ARGUMENT by the servicer guard, see the worker and router integration tests) and junk traffic
logs one line per interval, not a traceback per call."""

from __future__ import annotations

import logging

import pytest

from chariot.contracts.grpc_server import OncePerInterval, Undecodable, tolerant_decoder
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
