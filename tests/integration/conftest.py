"""Integration fixtures: a real Prometheus (`tests/prometheus.py`) that never outlives its test.

`make test` runs `python -m pytest`, which puts the repository root on `sys.path`, so `tests.prometheus`
imports as a namespace package; the root is added here too so a bare `pytest` run behaves the same.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tests.prometheus import PrometheusServer, PrometheusUnavailable, Targets, find_prometheus  # noqa: E402

PrometheusFactory = Callable[..., PrometheusServer]


@pytest.fixture(scope="session")
def prometheus_binary() -> str:
    """The Prometheus binary; a missing one fails loudly (it is a declared test dependency)."""
    try:
        return find_prometheus()
    except PrometheusUnavailable as e:
        pytest.fail(str(e), pytrace=False)


@pytest.fixture
def prometheus(prometheus_binary: str) -> Iterator[PrometheusFactory]:
    """`prometheus(targets, scrape_interval_s=1.0)` starts a server; all are stopped at teardown."""
    servers: list[PrometheusServer] = []

    def start(targets: Targets = (), **kwargs: Any) -> PrometheusServer:
        server = PrometheusServer(targets, binary=prometheus_binary, **kwargs)
        servers.append(server)
        return server.start()

    try:
        yield start
    finally:
        for server in servers:
            server.stop()
