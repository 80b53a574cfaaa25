"""A local pipeline group (`start_group`, what `chariot up` runs per replica) forms on the
rendezvous socket its launcher reserved, whichever process runs stage 0's engine: the worker
itself (`--engine-core thread`) or its engine-core child (`process`), which receives the socket
duplicated. Real worker processes, a real tiny model."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from chariot.contracts.processes import shutdown, wait_ready
from chariot.worker.config import EngineConfig
from chariot.worker.pipeline.launcher import start_group


@pytest.mark.slow
@pytest.mark.parametrize("engine_core", ["thread", "process"])
def test_a_two_stage_group_forms_on_its_reserved_socket(tiny_model_dir: Path, engine_core: str) -> None:
    config = EngineConfig(model=str(tiny_model_dir), pipeline_stages=2, dtype="float32", max_model_len=256,
                          kv_cache_tokens=2048)
    children, stage0 = start_group(0, config, "tiny", engine_core, iteration_log=None)
    try:
        line = wait_ready(stage0, children, timeout=180)
        host, port = line.split("grpc=")[1].split()[0].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10):
            pass  # stage 0 serves, so every stage met at the store
        assert all(c.proc.poll() is None for c in children)
    finally:
        shutdown(children, grace_s=10.0)
    assert [c.proc.returncode for c in children] == [0, 0]
