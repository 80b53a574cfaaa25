"""A local group's rank 0 serves its rendezvous on a socket its parent bound before writing the port
into the group's environment (`reserve_rendezvous`, `CHARIOT_RENDEZVOUS_FD`).

A port that is only found free (bind to 0, close, hand the number on) can be taken by any socket in
the seconds before stage 0 binds it: `chariot up` with two replicas once failed so, replica 1's
stage 0 exiting with "rendezvous store cannot listen on 127.0.0.1:…: Address already in use" while
replica 0's stages were opening their gloo connections. Real sockets, real child processes and a
real `TCPStore` here.
"""

from __future__ import annotations

import datetime
import errno
import os
import socket
import sys

import pytest
import torch.distributed as dist

from chariot.contracts.errors import ConfigError, PipelineError
from chariot.contracts.processes import RENDEZVOUS_FD, Topology, reserve_rendezvous, spawn, stage_env, wait_ready
from chariot.worker.pipeline.transport import rendezvous

# A torch-free stage 0 stand-in: adopts the descriptor its environment names, says which port it
# listens on, and answers one connection.
ADOPTS_AND_ANSWERS = """
import os, socket
sock = socket.socket(fileno=int(os.environ["CHARIOT_RENDEZVOUS_FD"]))
print("ready", os.environ["MASTER_PORT"], sock.getsockname()[1], flush=True)
conn, _ = sock.accept()
conn.sendall(b"stage 0")
conn.close()
"""


def test_a_reserved_port_cannot_be_taken_while_it_waits_for_stage_0() -> None:
    with reserve_rendezvous() as listener:
        port = listener.getsockname()[1]
        with socket.socket() as other:
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            with pytest.raises(OSError) as err:
                other.bind(("127.0.0.1", port))
        assert err.value.errno == errno.EADDRINUSE


def test_only_rank_0_is_given_the_descriptor_and_no_rank_inherits_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RENDEZVOUS_FD, "7")  # this process's own, from its parent: meaningless to its children
    reserved = Topology(0, 3, "127.0.0.1", 29500, listen_fd=5)
    assert stage_env(reserved, 0)[RENDEZVOUS_FD] == "5"
    assert RENDEZVOUS_FD not in stage_env(reserved, 1)
    assert RENDEZVOUS_FD not in stage_env(Topology(0, 3, "127.0.0.1", 29500), 0)


def rank_env(monkeypatch: pytest.MonkeyPatch, rank: int, fd: str) -> None:
    for name, value in {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
                        RENDEZVOUS_FD: fd}.items():
        monkeypatch.setenv(name, value)


def test_rank_0_reads_its_descriptor_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    rank_env(monkeypatch, 0, "9")
    assert Topology.from_env().listen_fd == 9
    rank_env(monkeypatch, 1, "9")
    assert Topology.from_env().listen_fd is None  # only rank 0 serves the store


def test_a_descriptor_that_is_not_a_number_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    rank_env(monkeypatch, 0, "socket")
    with pytest.raises(ConfigError) as err:
        Topology.from_env()
    assert err.value.field == RENDEZVOUS_FD and "'socket'" in err.value.message


def test_a_child_stage_0_adopts_the_reserved_socket() -> None:
    with reserve_rendezvous() as listener:
        port, fd = listener.getsockname()[1], listener.fileno()
        env = stage_env(Topology(0, 2, "127.0.0.1", port, fd), 0)
        child = spawn("stage 0", [sys.executable, "-c", ADOPTS_AND_ANSWERS], env, "ready", pass_fds=(fd,))
    try:  # the parent's copy is closed: the port is served by the child alone
        assert wait_ready(child, [], timeout=30).split()[1:] == [str(port), str(port)]
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            assert conn.recv(16) == b"stage 0"
        assert child.proc.wait(timeout=10) == 0
    finally:
        child.proc.kill()


def test_the_store_serves_on_the_adopted_socket_and_its_owner_keeps_the_original() -> None:
    timeout = datetime.timedelta(seconds=10)
    with reserve_rendezvous() as listener:
        port = listener.getsockname()[1]
        store = rendezvous(Topology(0, 1, "127.0.0.1", port, listener.fileno()), timeout)
        store.set("stage", "0")
        assert listener.fileno() >= 0 and listener.getsockname()[1] == port
        client = dist.TCPStore("127.0.0.1", port, 1, is_master=False, timeout=timeout)
        assert client.get("stage") == b"0"
        del client, store


def test_a_descriptor_on_another_port_or_closed_is_refused_by_name() -> None:
    timeout = datetime.timedelta(seconds=5)
    with reserve_rendezvous() as listener:
        port = listener.getsockname()[1]
        with pytest.raises(PipelineError, match=f"{RENDEZVOUS_FD}=.*not a listener on MASTER_PORT={port + 1}"):
            rendezvous(Topology(0, 1, "127.0.0.1", port + 1, listener.fileno()), timeout)
        closed = os.dup(listener.fileno())
        os.close(closed)
        with pytest.raises(PipelineError, match=f"{RENDEZVOUS_FD}={closed} is not an open socket"):
            rendezvous(Topology(0, 1, "127.0.0.1", port, closed), timeout)
        read_end, write_end = os.pipe()  # open, but not a socket
        try:
            with pytest.raises(PipelineError, match=f"{RENDEZVOUS_FD}={read_end} is not an open socket"):
                rendezvous(Topology(0, 1, "127.0.0.1", port, read_end), timeout)
        finally:
            os.close(read_end)
            os.close(write_end)
        with socket.socket() as other:  # the refusals left the reserved socket serving
            other.settimeout(5)
            other.connect(("127.0.0.1", port))
