"""A test kubelet (plus the Deployment controller's job) for the API emulator.

Why: the emulator stores pods but nothing runs them (docs/architecture.md §8). This plays the node and the
controllers the operator relies on, through the API only, like the real ones:

- **Deployment controller**: for each Deployment, keeps `spec.replicas` pods of its template (named
  `<deployment>-<template hash>-<i>`, owned by it), replaces pods of an old template, deletes pods of
  deleted Deployments, and writes `status` (`replicas`, `readyReplicas`, `availableReplicas`, ...).
- **kubelet**, in one of two modes:
  - `FakeRuntime` — marks each new pod Running and Ready after `ready_delay_s`; `fail(pod)` makes it
    exit (phase Failed) as a crashed worker would;
  - `LocalRuntime` — runs each pod's init containers, then its container, as local processes, and
    runs the container's probes (gRPC health, HTTP GET or TCP) as a kubelet does: the startup probe
    first, then liveness and readiness, each every `periodSeconds` after `initialDelaySeconds`; the
    pod is Ready after a readiness success and not Ready after `failureThreshold` failures in a row;
    `failureThreshold` liveness (or startup) failures in a row kill the container, which restarts with
    restartPolicy Always (`restartCount` goes up) and otherwise ends the pod as Failed/Succeeded,
    as a process that exits on its own does; a pod deleted from the API has its processes terminated.
    Probe times are multiplied by `probe_time_scale` (the counts are not), so a test sees in seconds
    what a kubelet would do in minutes.

`LocalRuntime` cannot give each pod its own network namespace and filesystem, so it rewrites what a
pod sees, explicitly (all rules in `LocalRuntime.remap_*`):

| in the pod spec                                   | locally                                        |
|---------------------------------------------------|------------------------------------------------|
| `--host 0.0.0.0`, `--metrics-host 0.0.0.0`        | `127.0.0.1`                                    |
| `--port N`, `--*-port N` (N a declared containerPort) | a free loopback port, fixed per (pod, N)   |
| env `MASTER_ADDR=<pod>.<svc>.<ns>.svc`            | `127.0.0.1`                                    |
| env `MASTER_PORT=N`                               | the port mapped for (`<pod>` of MASTER_ADDR, N) |
| a path under a volume's `mountPath` (args, env)   | that volume's directory under the work dir     |
| emptyDir volume                                   | an empty directory per pod and volume          |
| configMap volume                                  | its keys as files, re-projected while running  |
| `<pod>.<svc>.<ns>.svc:N` inside configMap files   | `127.0.0.1:<port mapped for (pod, N)>`         |
| command `chariot ...`                             | this interpreter's `chariot` entry point        |

Every process gets a parent-death signal so a killed test run leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from chariot.contracts.death_signal import popen_tied
from chariot.operator.kube import ApiError, Kube, Ref

Manifest = dict[str, Any]
TEMPLATE_HASH = "pod-template-hash"
SVC_ADDRESS = re.compile(r"\b([a-z0-9]([-a-z0-9]*[a-z0-9])?)\.[a-z0-9-]+\.[a-z0-9-]+\.svc(?:\.cluster\.local)?:(\d+)\b")


@dataclass
class PodReport:
    phase: str
    ready: bool
    exit_code: int | None = None
    message: str = ""
    restarts: int = 0


class Runtime(Protocol):
    def sync(self, pod: Manifest) -> PodReport: ...
    def known(self) -> set[str]: ...
    def forget(self, uid: str) -> None: ...
    def close(self) -> None: ...


def now_rfc3339() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# --- fake runtime --------------------------------------------------------------------------------

class FakeRuntime:
    """Pods become Running + Ready `ready_delay_s` after the kubelet first sees them."""

    def __init__(self, ready_delay_s: float = 0.2) -> None:
        self.ready_delay_s = ready_delay_s
        self.first_seen: dict[str, float] = {}
        self.failed: dict[str, int] = {}

    def sync(self, pod: Manifest) -> PodReport:
        uid, name = pod["metadata"]["uid"], pod["metadata"]["name"]
        seen = self.first_seen.setdefault(uid, time.monotonic())
        if name in self.failed:
            return PodReport("Failed", False, self.failed[name], "worker exited")
        if time.monotonic() - seen < self.ready_delay_s:
            return PodReport("Pending", False)
        return PodReport("Running", True)

    def fail(self, name: str, exit_code: int = 1) -> None:
        self.failed[name] = exit_code

    def known(self) -> set[str]:
        return set(self.first_seen)

    def forget(self, uid: str) -> None:
        self.first_seen.pop(uid, None)

    def close(self) -> None:
        pass


# --- local process runtime -----------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LocalPod:
    pod: Manifest
    root: Path
    mounts: dict[str, Path] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None
    state: str = "Init"  # Init -> Running -> Done
    exit_code: int | None = None
    ready: bool = False
    thread: threading.Thread | None = None
    stopped: bool = False
    restarts: int = 0
    probes: ProbeState = field(default_factory=lambda: ProbeState(time.monotonic()))


@dataclass
class ProbeState:
    """One container run's probe bookkeeping (reset when the container restarts)."""

    started_at: float
    started: bool = False  # the startup probe passed (or there is none)
    failures: dict[str, int] = field(default_factory=dict)  # consecutive, by probe kind
    next_at: dict[str, float] = field(default_factory=dict)


PROBE_KINDS = ("startupProbe", "livenessProbe", "readinessProbe")


class LocalRuntime:
    """Runs pods as local processes with the remapping documented in the module docstring."""

    def __init__(self, kube: Kube, workdir: Path, chariot: list[str] | None = None,
                 probe_time_scale: float = 1.0) -> None:
        self.kube = kube
        self.workdir = workdir
        self.chariot = chariot or which_chariot()
        self.probe_time_scale = probe_time_scale
        self.ports: dict[tuple[str, int], int] = {}
        self.pods: dict[str, LocalPod] = {}
        self.lock = threading.Lock()

    # remapping -----------------------------------------------------------------------------------

    def port(self, pod_name: str, container_port: int) -> int:
        with self.lock:
            return self.ports.setdefault((pod_name, container_port), free_port())

    def remap_path(self, value: str, mounts: dict[str, Path]) -> str:
        for mount_path, local in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
            if value == mount_path or value.startswith(mount_path.rstrip("/") + "/"):
                return str(local) + value[len(mount_path.rstrip("/")):]
        return value

    def remap_args(self, pod: Manifest, args: list[str], mounts: dict[str, Path]) -> list[str]:
        declared = {p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
        out: list[str] = []
        for i, arg in enumerate(args):
            flag = args[i - 1] if i else ""
            if flag in ("--host", "--metrics-host") and arg == "0.0.0.0":
                out.append("127.0.0.1")
            elif re.fullmatch(r"--([\w-]+-)?port", flag) and arg.isdigit() and int(arg) in declared:
                out.append(str(self.port(pod["metadata"]["name"], int(arg))))
            else:
                out.append(self.remap_path(arg, mounts))
        return out

    def remap_env(self, env: list[Manifest], mounts: dict[str, Path]) -> dict[str, str]:
        values = {e["name"]: str(e.get("value", "")) for e in env}
        master = values.get("MASTER_ADDR", "")
        if master:
            values["MASTER_ADDR"] = "127.0.0.1"
            if values.get("MASTER_PORT", "").isdigit():
                values["MASTER_PORT"] = str(self.port(master.split(".")[0], int(values["MASTER_PORT"])))
        return {k: self.remap_path(v, mounts) for k, v in values.items()}

    def remap_text(self, text: str) -> str:
        return SVC_ADDRESS.sub(lambda m: f"127.0.0.1:{self.port(m.group(1), int(m.group(3)))}", text)

    def command(self, container: Manifest, pod: Manifest, mounts: dict[str, Path]) -> list[str]:
        """The image's `chariot` becomes the local entry point (not remapped: it is not inside the pod)."""
        cmd = list(container.get("command") or [])
        entry = self.chariot if cmd[:1] == ["chariot"] else cmd[:1]
        return [*entry, *self.remap_args(pod, cmd[1:] + list(container.get("args") or []), mounts)]

    # volumes ---------------------------------------------------------------------------------------

    def _mounts(self, local: LocalPod, container: Manifest) -> dict[str, Path]:
        volumes = {v["name"]: v for v in local.pod["spec"].get("volumes") or []}
        mounts = {}
        for m in container.get("volumeMounts") or []:
            volume = volumes[m["name"]]
            path = local.root / "volumes" / m["name"]
            if "configMap" not in volume and "emptyDir" not in volume:
                raise RuntimeError(f"volume {m['name']}: only emptyDir and configMap are run locally")
            path.mkdir(parents=True, exist_ok=True)
            mounts[m["mountPath"]] = path
        return mounts

    def project_config_maps(self, local: LocalPod) -> None:
        """Write (and keep fresh) configMap volumes, rewriting in-cluster addresses to loopback."""
        ns = local.pod["metadata"]["namespace"]
        for volume in local.pod["spec"].get("volumes") or []:
            if "configMap" not in volume:
                continue
            cm = self.kube.get(Ref("ConfigMap", ns, volume["configMap"]["name"])) or {}
            target = local.root / "volumes" / volume["name"]
            target.mkdir(parents=True, exist_ok=True)
            for key, value in (cm.get("data") or {}).items():
                text = self.remap_text(value)
                path = target / key
                if not path.exists() or path.read_text() != text:
                    tmp = target / f".{key}.tmp"
                    tmp.write_text(text)
                    tmp.replace(path)  # atomic: a watcher never reads half a file

    # lifecycle -------------------------------------------------------------------------------------

    def sync(self, pod: Manifest) -> PodReport:
        uid = pod["metadata"]["uid"]
        with self.lock:
            local = self.pods.get(uid)
            if local is None:
                local = LocalPod(pod, self.workdir / f"{pod['metadata']['name']}-{uid[:8]}")
                self.pods[uid] = local
                local.thread = threading.Thread(target=self._run, args=(local,), daemon=True)
                local.thread.start()
        if local.state == "Done":
            phase = "Succeeded" if local.exit_code == 0 else "Failed"
            return PodReport(phase, False, local.exit_code, self._termination_message(local), local.restarts)
        if local.state == "Init":
            return PodReport("Pending", False)
        self.project_config_maps(local)
        self._run_probes(local)
        return PodReport("Running", local.ready, restarts=local.restarts)

    def _run_probes(self, local: LocalPod) -> None:
        """The probes that are due, with a kubelet's consequences (see the module docstring)."""
        container, state, now = local.pod["spec"]["containers"][0], local.probes, time.monotonic()
        state.started = state.started or "startupProbe" not in container
        for kind in PROBE_KINDS:
            probe = container.get(kind)
            if probe is None or (kind == "startupProbe") == state.started:
                continue
            scale = self.probe_time_scale
            delayed = now - state.started_at < probe.get("initialDelaySeconds", 0) * scale
            if delayed or now < state.next_at.get(kind, 0.0):
                continue
            state.next_at[kind] = now + probe.get("periodSeconds", 10) * scale
            ok = self._probe(local, probe)
            state.failures[kind] = 0 if ok else state.failures.get(kind, 0) + 1
            failed = state.failures[kind] >= probe.get("failureThreshold", 3)
            if kind == "readinessProbe":
                local.ready = ok or (local.ready and not failed)
            elif ok:
                state.started = True
            elif failed:
                local.ready = False
                self._kill(local, f"{kind} failed {state.failures[kind]} times")
                return

    def _kill(self, local: LocalPod, why: str) -> None:
        """As the kubelet does after failed liveness/startup probes: stop the container (its restart
        policy decides what follows, in `_run`)."""
        with (local.root / "kubelet.log").open("a") as log:
            log.write(f"{now_rfc3339()} killing the container: {why}\n")
        proc = local.process
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)

    def _run(self, local: LocalPod) -> None:
        local.root.mkdir(parents=True, exist_ok=True)
        self.project_config_maps(local)
        spec = local.pod["spec"]
        for init in spec.get("initContainers") or []:
            code = self._spawn(local, init).wait()
            if code != 0 or local.stopped:
                local.exit_code, local.state = code, "Done"
                return
        while True:
            local.probes = ProbeState(time.monotonic())
            local.process = self._spawn(local, spec["containers"][0])
            local.state = "Running"
            code = local.process.wait()
            if local.stopped or spec.get("restartPolicy", "Always") != "Always":
                local.exit_code, local.state = code, "Done"
                return
            local.restarts += 1
            local.ready = False
            time.sleep(min(0.5 * local.restarts, 5.0))  # the kubelet's crash-loop backoff, shortened

    @staticmethod
    def _termination_message(local: LocalPod) -> str:
        """As the kubelet's `FallbackToLogsOnError`: a failed container's message is the tail of its log
        (the last 80 lines, at most 2,048 bytes); otherwise a plain note of the exit code."""
        container = local.pod["spec"]["containers"][0]
        log = local.root / f"{container['name']}.log"
        if local.exit_code and container.get("terminationMessagePolicy") == "FallbackToLogsOnError" and log.is_file():
            tail = log.read_bytes()[-2048:].decode("utf-8", "replace").splitlines()[-80:]
            return "\n".join(tail)
        return f"exited with {local.exit_code}"

    def _spawn(self, local: LocalPod, container: Manifest) -> subprocess.Popen[bytes]:
        mounts = self._mounts(local, container)
        env = {**os.environ, **self.remap_env(container.get("env") or [], mounts)}
        log = (local.root / f"{container['name']}.log").open("ab")  # a restarted container appends
        cmd = self.command(container, local.pod, mounts)
        (local.root / f"{container['name']}.cmd").write_text(json.dumps(cmd))
        return popen_tied(cmd, death_signal=signal.SIGTERM, env=env, stdout=log, stderr=subprocess.STDOUT,
                          cwd=local.root, start_new_session=True)

    def _probe(self, local: LocalPod, probe: Manifest) -> bool:
        name = local.pod["metadata"]["name"]
        kind = next(k for k in ("grpc", "httpGet", "tcpSocket") if k in probe)
        port = self.port(name, int(probe[kind]["port"])) if isinstance(probe[kind]["port"], int) \
            else self._named_port(local.pod, probe[kind]["port"])
        checks: dict[str, Callable[[], bool]] = {
            "grpc": lambda: _grpc_serving(port),
            "httpGet": lambda: _http_ok(port, probe["httpGet"].get("path", "/")),
            "tcpSocket": lambda: _tcp_open(port),
        }
        try:
            return checks[kind]()
        except Exception:
            return False

    def _named_port(self, pod: Manifest, name: str) -> int:
        for p in pod["spec"]["containers"][0].get("ports", []):
            if p.get("name") == name:
                return self.port(pod["metadata"]["name"], p["containerPort"])
        raise KeyError(name)

    def logs(self, name_prefix: str = "") -> str:
        out = []
        for local in list(self.pods.values()):
            if local.pod["metadata"]["name"].startswith(name_prefix):
                for log in sorted(local.root.glob("*.log")):
                    out.append(f"==> {local.pod['metadata']['name']}/{log.name}\n{log.read_text()[-4000:]}")
        return "\n".join(out)

    def known(self) -> set[str]:
        with self.lock:
            return set(self.pods)

    def forget(self, uid: str) -> None:
        with self.lock:
            local = self.pods.pop(uid, None)
        if local is not None:
            _stop(local)

    def close(self) -> None:
        with self.lock:
            pods, self.pods = list(self.pods.values()), {}
        for local in pods:
            _stop(local)


def _stop(local: LocalPod) -> None:
    local.stopped = True
    proc = local.process
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


def _grpc_serving(port: int) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def _http_ok(port: int, path: str) -> bool:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=1) as resp:
        return 200 <= resp.status < 400


def _tcp_open(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=1):
        return True


# --- the kubelet + Deployment controller loop ----------------------------------------------------

def template_hash(deployment: Manifest) -> str:
    return hashlib.sha256(json.dumps(deployment["spec"]["template"], sort_keys=True).encode()).hexdigest()[:8]


class TestKubelet:
    """Polls the API (every `poll_s`) and plays kubelet + Deployment controller for one namespace."""

    __test__ = False  # not a pytest test class

    def __init__(self, kube: Kube, namespace: str, runtime: Runtime, poll_s: float = 0.1) -> None:
        self.kube, self.namespace, self.runtime, self.poll_s = kube, namespace, runtime, poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="test-kubelet", daemon=True)
        self.errors: list[str] = []

    def __enter__(self) -> TestKubelet:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self.runtime.close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync_once()
            except (ApiError, OSError) as exc:
                self.errors.append(str(exc))
            self._stop.wait(self.poll_s)

    def sync_once(self) -> None:
        deployments = self.kube.request("GET", Ref("Deployment", self.namespace).path())["items"]
        pods = self.kube.request("GET", Ref("Pod", self.namespace).path())["items"]
        self._sync_deployments(deployments, pods)
        live = set()
        for pod in pods:
            live.add(pod["metadata"]["uid"])
            self._sync_pod(pod)
        for uid in self.runtime.known() - live:
            self.runtime.forget(uid)

    def _sync_pod(self, pod: Manifest) -> None:
        report = self.runtime.sync(pod)
        status = pod.get("status") or {}
        ready = "True" if report.ready else "False"
        current_ready = next((c["status"] for c in status.get("conditions") or [] if c["type"] == "Ready"), None)
        restarts = next((c.get("restartCount", 0) for c in status.get("containerStatuses") or []), 0)
        if status.get("phase") == report.phase and current_ready == ready and restarts == report.restarts:
            return
        state: Manifest = {"running": {"startedAt": now_rfc3339()}} if report.phase == "Running" else (
            {"terminated": {"exitCode": report.exit_code, "reason": "Error" if report.exit_code else "Completed",
                            "message": report.message}} if report.phase in ("Failed", "Succeeded")
            else {"waiting": {"reason": "ContainerCreating"}})
        new_status = {
            "phase": report.phase, "podIP": "127.0.0.1", "hostIP": "127.0.0.1",
            "conditions": [{"type": t, "status": ready if t in ("Ready", "ContainersReady") else "True",
                            "lastTransitionTime": now_rfc3339()}
                           for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")],
            "containerStatuses": [{"name": c["name"], "ready": report.ready, "restartCount": report.restarts,
                                   "image": c["image"],
                                   "imageID": "", "state": state} for c in pod["spec"]["containers"]],
        }
        with contextlib.suppress(ApiError):  # deleted meanwhile
            self.kube.merge_patch(Ref("Pod", self.namespace, pod["metadata"]["name"]), {"status": new_status},
                                  subresource="status")

    def _sync_deployments(self, deployments: list[Manifest], pods: list[Manifest]) -> None:
        by_uid = {d["metadata"]["uid"]: d for d in deployments}
        for pod in pods:
            owner = next((o for o in pod["metadata"].get("ownerReferences") or [] if o["kind"] == "Deployment"), None)
            if owner is not None and owner["uid"] not in by_uid:
                self.kube.delete(Ref("Pod", self.namespace, pod["metadata"]["name"]))
        for d in deployments:
            self._sync_deployment(d, [p for p in pods if any(
                o["uid"] == d["metadata"]["uid"] for o in p["metadata"].get("ownerReferences") or [])])

    def _sync_deployment(self, d: Manifest, pods: list[Manifest]) -> None:
        h = template_hash(d)
        name = d["metadata"]["name"]
        wanted = {f"{name}-{h}-{i}" for i in range(int(d["spec"].get("replicas", 1)))}
        for pod in pods:
            if pod["metadata"]["name"] not in wanted:
                self.kube.delete(Ref("Pod", self.namespace, pod["metadata"]["name"]))
        existing = {p["metadata"]["name"] for p in pods}
        for pod_name in sorted(wanted - existing):
            template = d["spec"]["template"]
            meta = {"name": pod_name, "namespace": self.namespace,
                    "labels": {**template["metadata"].get("labels", {}), TEMPLATE_HASH: h},
                    "annotations": template["metadata"].get("annotations", {}),
                    "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": name,
                                         "uid": d["metadata"]["uid"], "controller": True}]}
            self.kube.create(Ref("Pod", self.namespace), {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
                                                          "spec": template["spec"]})
        current = [p for p in pods if p["metadata"]["name"] in wanted]
        ready = sum(1 for p in current if any(c["type"] == "Ready" and c["status"] == "True"
                                              for c in (p.get("status") or {}).get("conditions") or []))
        status = {"observedGeneration": d["metadata"].get("generation", 1), "replicas": len(pods),
                  "updatedReplicas": len(current), "readyReplicas": ready, "availableReplicas": ready}
        if {k: (d.get("status") or {}).get(k) for k in status} != status:
            self.kube.merge_patch(Ref("Deployment", self.namespace, name), {"status": status}, subresource="status")


def which_chariot() -> list[str]:
    """The `chariot` entry point of the interpreter running the tests (the pods' image, locally)."""
    found = Path(sys.executable).with_name("chariot")
    return [str(found)] if found.exists() else [shutil.which("chariot") or "chariot"]
