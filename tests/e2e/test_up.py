"""`chariot up` end to end: the embedded default as real processes (router + 2-stage worker), driven
through real HTTP and gRPC clients and the `chariot generate` CLI, then stopped with Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from chariot.contracts.proto_codec import request_to_proto
from chariot.proto.chariot.v1 import generation_pb2_grpc
from chariot.worker import LLM, SamplingParams
from chariot.worker.iteration_log import iteration_log_path, read_iterations

PROMPT = "The quick brown fox"
MAX_TOKENS = 12
ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "256", "--kv-cache-tokens", "2048"]


def descendants(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    children: dict[int, list[int]] = {}
    for line in out.splitlines():
        p, pp = (int(x) for x in line.split())
        children.setdefault(pp, []).append(p)
    found, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            found.append(c)
            todo.append(c)
    return found


@pytest.fixture(scope="module")
def iteration_log(tmp_path_factory):
    """The `--iteration-log` `up` is given; replica 0 writes `iteration_log_path(it, 0)`."""
    return tmp_path_factory.mktemp("up-iterations") / "iterations.jsonl"


@pytest.fixture(scope="module")
def up(tiny_model_dir, iteration_log):
    cmd = [sys.executable, "-m", "chariot.cli", "up", "--model", str(tiny_model_dir), "--stages", "2",
           "--http-port", "0", "--grpc-port", "0", "--iteration-log", str(iteration_log), *ENGINE_FLAGS]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + 240
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("chariot up ready"):
            break
        assert time.monotonic() < deadline, "chariot up did not become ready"
    ready = lines[-1]
    assert ready.startswith("chariot up ready"), "".join(lines)
    http = re.search(r"http=(\S+)", ready).group(1)
    grpc_addr = re.search(r"grpc=(\S+)", ready).group(1)
    health_at_ready = _health(http)  # read at once: `ready` promises a router that routes
    yield proc, http, grpc_addr, "".join(lines), health_at_ready
    if proc.poll() is None:
        proc.kill()


@pytest.fixture(scope="module")
def expected(tiny_model_dir):
    with LLM(str(tiny_model_dir), dtype="float32", max_model_len=256, kv_cache_tokens=2048, progress=False) as llm:
        return llm.generate(PROMPT, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))[0]


@pytest.mark.slow
def test_http_completion_matches_offline(up, expected, tiny_model_dir):
    _, http, _, banner, health = up
    assert health["ready_replicas"] == health["replicas"] == 1, health  # routable from the ready line on
    assert f"http://{http}/v1" in banner and "gRPC" in banner
    body = {"model": Path(tiny_model_dir).name, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}
    req = urllib.request.Request(f"http://{http}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        out = json.loads(resp.read())
    assert out["choices"][0]["text"] == expected.text
    assert out["usage"]["completion_tokens"] == MAX_TOKENS


def _offset_once_idle(path: Path, timeout_s: float = 10.0) -> int:
    """The log's end once its last line shows an idle engine (nothing running or waiting): an earlier
    test's request has its last step logged just after its tokens are delivered, which must not count
    as this test's."""
    records, offset = read_iterations(path)
    deadline = time.monotonic() + timeout_s
    while records and (records[-1]["running"] or records[-1]["waiting"]):
        assert time.monotonic() < deadline, f"the engine did not go idle: {records[-1]}"
        time.sleep(0.05)
        more, offset = read_iterations(path, offset)
        records += more
    return offset


@pytest.mark.slow
def test_stage0_logs_the_iterations_of_a_request(up, expected, iteration_log):
    _, http, _, _, _ = up
    path = iteration_log_path(iteration_log, 0)
    offset = _offset_once_idle(path)
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(f"http://{http}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert json.loads(resp.read())["usage"]["completion_tokens"] == MAX_TOKENS
    records: list[dict] = []
    deadline = time.monotonic() + 10  # the front logs a step right after delivering its tokens
    while sum(r["decodes"] for r in records) < MAX_TOKENS - 1 and time.monotonic() < deadline:
        time.sleep(0.05)
        more, offset = read_iterations(path, offset)
        records += more
    assert sum(r["prefill"] for r in records) == len(expected.prompt_token_ids)
    assert sum(r["last"] for r in records) == 1  # one prompt finished: the first token
    assert sum(r["decodes"] for r in records) == MAX_TOKENS - 1
    assert all(r["tokens"] == r["prefill"] + r["decodes"] and r["exec_ms"] > 0 for r in records)


@pytest.mark.slow
def test_grpc_stream_matches_offline(up, expected):
    _, _, grpc_addr, _, _ = up
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with grpc.insecure_channel(grpc_addr) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        tokens = [t for r in stub.Generate(request_to_proto(PROMPT, params), timeout=60) for t in r.token_ids]
    assert tokens == expected.token_ids


@pytest.mark.slow
def test_generate_cli_streams_from_up(up, expected):
    _, _, grpc_addr, _, _ = up
    out = subprocess.run([sys.executable, "-m", "chariot.cli", "generate", "--target", grpc_addr,
                          "--max-tokens", str(MAX_TOKENS), PROMPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(PROMPT)
    assert "finish=" in out.stderr


@pytest.mark.slow
def test_ctrl_c_stops_everything(up):
    proc = up[0]
    kids = descendants(proc.pid)
    assert len(kids) >= 3  # two stages and the router
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0
    deadline = time.monotonic() + 15
    while any(os.path.exists(f"/proc/{k}") and _alive(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [k for k in kids if os.path.exists(f"/proc/{k}") and _alive(k)], "orphaned processes"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def _stage_pids(up_pid: int) -> dict[tuple[str, int], int]:
    """(rendezvous port, rank) → pid of every `chariot worker` stage under `chariot up`."""
    found = {}
    for pid in descendants(up_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"worker" in cmdline and b"chariot.worker" in cmdline:
            env = _environ(pid)
            if "RANK" in env:
                found[env["MASTER_PORT"], int(env["RANK"])] = pid
    return found


def _health(http: str) -> dict:
    try:
        with urllib.request.urlopen(f"http://{http}/health", timeout=10) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return json.loads(err.read())


def _complete(http: str, model: str) -> int:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(f"http://{http}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_dead_stage_costs_only_its_group_which_comes_back(tiny_model_dir, tmp_path):
    """`--replicas 2`, `kill -9` of one group's stage 1: the router and the other group serve on
    (≥ 90 % of the requests started 5 s later succeed), and the dead group is recreated after its
    backoff and reports ready again."""
    log = tmp_path / "up.log"
    cmd = [sys.executable, "-m", "chariot.cli", "up", "--model", str(tiny_model_dir), "--stages", "2",
           "--replicas", "2", "--http-port", "0", "--grpc-port", "0", "--restart-backoff-seconds", "2",
           *ENGINE_FLAGS]
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        assert proc.stdout is not None
        ready = next((line for line in proc.stdout if line.startswith("chariot up ready")), "")
        assert ready, log.read_text()[-3000:]
        http = re.search(r"http=(\S+)", ready).group(1)
        model = Path(tiny_model_dir).name
        stages = _stage_pids(proc.pid)
        assert len(stages) == 4, stages
        victim_port = sorted({port for port, _ in stages})[0]
        os.kill(stages[victim_port, 1], signal.SIGKILL)

        time.sleep(5.0)
        codes = [_complete(http, model) for _ in range(20)]
        assert sum(c == 200 for c in codes) >= 18, codes
        assert proc.poll() is None, "chariot up must keep running"

        deadline = time.monotonic() + 180
        while _health(http).get("ready_replicas") != 2:
            assert time.monotonic() < deadline, f"the dead group did not come back:\n{log.read_text()[-3000:]}"
            time.sleep(1.0)
        text = log.read_text()
        assert "fails alone" in text and "recreated" in text, text[-3000:]
        assert all(_complete(http, model) == 200 for _ in range(4))
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
