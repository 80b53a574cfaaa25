"""Point-to-point links between stages with deadlines, over torch.distributed.

Every receive has a timeout; a peer that died (connection closed) or stopped answering surfaces
as `PipelineError` within that time instead of a hang. Sends are asynchronous so a stage can go
back to receiving while its output is still on the wire.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import socket
import time
from collections import deque
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist

from chariot.contracts.errors import PipelineError
from chariot.contracts.processes import LISTEN_BACKLOG, RENDEZVOUS_FD, Topology

MAX_PENDING_SENDS = 12
# Stages start at different speeds (imports, model loading, on a cluster node scale-up and image
# pulls): joining the group may take far longer than any single message is allowed to. The join
# deadline is `EngineConfig.rendezvous_timeout_s`; per-message deadlines are `stage_timeout_s`.
_JOINED_KEY = "chariot/stages-joined"


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


PeerCheck = Callable[[], str | None]
"""Returns why a peer stage cannot join (e.g. a local child exited), or None while all is well."""


def listen_socket(topo: Topology, deadline: float) -> socket.socket:
    """Stage 0's store socket, bound to the rendezvous address itself, never a wildcard.

    (`TCPStore` on its own listens on every interface, unauthenticated.) A local group's parent has
    already bound and handed it over (`Topology.listen_fd`); in a pod it is bound here. The address
    may be a pod's DNS name that resolves only once the pod has an IP, so resolution is retried
    until `deadline`.
    """
    if topo.listen_fd is not None:
        return adopted_socket(topo.listen_fd, topo.master_port)
    addr, port = topo.master_addr, topo.master_port
    while True:
        try:
            family, kind, proto, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
            break
        except socket.gaierror as exc:
            if time.monotonic() > deadline:
                raise PipelineError(f"rendezvous address MASTER_ADDR={addr!r} does not resolve: {exc}") from exc
            time.sleep(0.5)
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(sockaddr)
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        raise PipelineError(f"rendezvous store cannot listen on {addr}:{port}: {exc}") from exc
    return sock


def adopted_socket(fd: int, port: int) -> socket.socket:
    """A duplicate of the listening socket the parent reserved (the original stays its owner's to
    close), checked to listen on MASTER_PORT."""
    try:
        copy = os.dup(fd)
    except OSError as exc:
        raise PipelineError(f"{RENDEZVOUS_FD}={fd} is not an open socket: {exc}") from exc
    try:
        sock = socket.socket(fileno=copy)
    except OSError as exc:
        os.close(copy)
        raise PipelineError(f"{RENDEZVOUS_FD}={fd} is not an open socket: {exc}") from exc
    bound = sock.getsockname()
    if sock.type != socket.SOCK_STREAM or bound[1] != port:
        sock.close()
        raise PipelineError(f"{RENDEZVOUS_FD}={fd} is a socket on {bound}, not a listener on MASTER_PORT={port}")
    return sock


def loopback_only(topo: Topology) -> None:
    """A group that meets on a loopback address keeps gloo's own listeners on loopback too."""
    try:
        loopback = ipaddress.ip_address(socket.gethostbyname(topo.master_addr)).is_loopback
    except (OSError, ValueError):
        return
    names = {name for _, name in socket.if_nameindex()}
    if loopback and "lo" in names:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def rendezvous(topo: Topology, timeout: datetime.timedelta, peer_check: PeerCheck | None = None) -> dist.TCPStore:
    """Meet every stage at stage 0's TCP store, polling so a stage that died is reported at once
    (through `peer_check`) instead of after the whole rendezvous timeout.

    On stage 0 the store serves on a socket bound to the rendezvous address (see `listen_socket`);
    the store owns that socket from then on and closes it when it goes."""
    deadline = time.monotonic() + timeout.total_seconds()
    sock = listen_socket(topo, deadline) if topo.is_first else None
    try:
        store = dist.TCPStore(topo.master_addr, topo.master_port, topo.world_size, is_master=topo.is_first,
                              timeout=timeout, wait_for_workers=False,
                              master_listen_fd=None if sock is None else sock.fileno())
    except BaseException:
        if sock is not None:
            sock.close()
        raise
    if sock is not None:
        sock.detach()  # the store closes the descriptor
    # One key per rank, not a counter: a rank whose pod was replaced before the group started (the
    # operator's RecreateGroupAfterStart) joins again without being counted twice.
    keys = [f"{_JOINED_KEY}/{rank}" for rank in range(topo.world_size)]
    store.set(keys[topo.rank], "1")
    while not store.check(keys):
        problem = peer_check() if peer_check is not None else None
        if problem is not None:
            raise PipelineError(f"pipeline rendezvous failed: {problem}")
        if time.monotonic() > deadline:
            joined = sum(store.check([key]) for key in keys)
            raise PipelineError(f"pipeline rendezvous timed out: {joined} of {topo.world_size} ranks joined "
                                f"{topo.master_addr}:{topo.master_port}")
        time.sleep(0.05)
    return store


class StageLink:
    """This stage's sends and receives; owns the process group for its lifetime.

    Peers are named by pipeline stage; with tensor parallelism a stage's messages go to and from
    its leader (global rank stage × `tensor_parallel_size`), the only rank of a stage that talks to
    other stages."""

    def __init__(self, topo: Topology, device: torch.device, timeout_s: float,
                 peer_check: PeerCheck | None = None, join_timeout_s: float = 180.0,
                 tensor_parallel_size: int = 1) -> None:
        if dist.is_initialized():
            raise PipelineError("a torch.distributed process group already exists in this process")
        self.topo = topo
        self.tensor_parallel_size = tensor_parallel_size
        self.stage = topo.rank // tensor_parallel_size
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.device = device  # tensors cross the wire from here (cuda for nccl, cpu for gloo)
        join_timeout = datetime.timedelta(seconds=max(timeout_s, join_timeout_s))
        loopback_only(topo)
        store = rendezvous(topo, join_timeout, peer_check)
        dist.init_process_group(backend_for(device), store=store, rank=topo.rank, world_size=topo.world_size,
                                timeout=join_timeout)
        self._sends: deque[tuple[dist.Work, list[torch.Tensor]]] = deque()

    def send(self, tensors: list[torch.Tensor], dst: int) -> None:
        """Queue tensors to `dst` in order; buffers stay alive until the send completes."""
        self._reap()
        wire = [t.to(self.device).contiguous() for t in tensors]
        for t in wire:
            work = self._start(partial(dist.isend, t, dst * self.tensor_parallel_size), dst, "send to")
            self._sends.append((work, wire))
        while len(self._sends) > MAX_PENDING_SENDS:
            self._wait(self._sends.popleft()[0], dst, "send to")

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, timeout: datetime.timedelta | None = None,
             ) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        work = self._start(lambda: dist.irecv(buf, src * self.tensor_parallel_size), src, "receive from")
        self._wait(work, src, "receive from", timeout)
        return buf

    def flush(self) -> None:
        while self._sends:
            self._wait(self._sends.popleft()[0], -1, "send")

    def close(self) -> None:
        with contextlib.suppress(PipelineError):
            self.flush()
        dist.destroy_process_group()

    def _reap(self) -> None:
        while self._sends and self._sends[0][0].is_completed():
            self._sends.popleft()

    def _start(self, op: Callable[[], dist.Work | None], peer: int, what: str) -> dist.Work:
        """Post a send/receive; a peer that is already gone can make posting itself fail."""
        try:
            work = op()
        except RuntimeError as exc:
            raise self._broken(peer, what, exc) from exc
        if work is None:
            raise PipelineError(f"pipeline stage {self.stage} cannot {what} stage {peer}")
        return work

    def _broken(self, peer: int, what: str, exc: BaseException, limit: datetime.timedelta | None = None,
                ) -> PipelineError:
        """A send/receive that failed, said as what happened: a peer that went silent past the
        deadline ("no answer from stage N within Ts") or one whose connection broke ("stage N
        connection lost"), with the transport's own first line."""
        who = f"stage {peer}" if peer >= 0 else "a peer stage"
        detail = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        me = f"pipeline stage {self.stage}"
        if limit is not None and _is_timeout(exc):
            return PipelineError(f"{me}: no answer from {who} within {limit.total_seconds():.0f}s "
                                 f"(waiting to {what} it): {detail}")
        return PipelineError(f"{me}: {who} connection lost (could not {what} it): {detail}")

    def _wait(self, work: dist.Work, peer: int, what: str, timeout: datetime.timedelta | None = None) -> None:
        limit = timeout or self.timeout
        try:
            if not work.wait(limit):
                raise RuntimeError("timed out")
        except RuntimeError as exc:
            raise self._broken(peer, what, exc, limit) from exc


def _is_timeout(exc: BaseException) -> bool:
    """gloo and NCCL report an expired wait as a RuntimeError whose text says so."""
    text = str(exc).lower()
    return isinstance(exc, TimeoutError) or "timed out" in text or "timeout" in text
