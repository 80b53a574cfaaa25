"""Pipeline-parallel stages over gloo on CPU: exact greedy parity with the single-process engine,
micro-batches overlapping in flight, and bounded failure when a stage dies or stops answering."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from chariot.contracts.errors import PipelineError
from chariot.worker import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPT_LENS = (1, 10, 14, 15, 20, 33, 45)


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def engine_kwargs(policy: str) -> dict:
    # 10 blocks of 16 tokens for ~140 prompt + 84 output tokens: preemption is forced under every
    # policy; sarathi's budget of 16 splits prompts into chunks across many micro-batches.
    return dict(policy=policy, token_budget=16 if policy == "sarathi" else None, dtype="float32",
                max_model_len=128, kv_cache_tokens=10 * 16, block_size=16, max_batch_size=8, progress=False)


@pytest.fixture(scope="module")
def references(tiny_model_dir, small_model_dir):
    """Single-process greedy outputs per (model, policy): the pipeline must reproduce them."""
    out = {}
    for name, d in (("tiny", tiny_model_dir), ("small", small_model_dir)):
        ps = prompts(500)
        for policy in ("sarathi", "vllm", "orca", "fastertransformer"):
            with LLM(str(d), **engine_kwargs(policy)) as llm:
                out[name, policy] = (ps, [o.token_ids for o in llm.generate(ps, GREEDY)])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["sarathi", "vllm", "orca", "fastertransformer"])
@pytest.mark.parametrize(("model", "stages", "split"), [("tiny", 2, None), ("small", 3, (2, 1, 1))])
def test_pipeline_matches_single_process(references, tiny_model_dir, small_model_dir, model, stages, split,
                                         policy):
    model_dir = tiny_model_dir if model == "tiny" else small_model_dir
    ps, expected = references[model, policy]
    with LLM(str(model_dir), pipeline_stages=stages, layer_split=split, **engine_kwargs(policy)) as llm:
        outs = llm.generate(ps, GREEDY)
        engine = llm.engine
        assert [o.token_ids for o in outs] == expected
        assert engine.scheduler.num_preemptions > 0
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
        assert engine.stats().pipeline_stages == stages


@pytest.mark.slow
def test_pipeline_carries_logit_processing_and_logprobs(tiny_model_dir):
    """Adjustments travel stage 0 -> last stage in the micro-batch, logprobs come back in the result:
    a 2-stage pipeline gives the single process's tokens and logprobs for a batch mixing them."""
    ps = prompts(500)[:4]
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3, frequency_penalty=1.0),
              SamplingParams(max_tokens=10, temperature=0.8, seed=5, ignore_eos=True, logit_bias={7: 4.0}),
              SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0, presence_penalty=-1.0),
              GREEDY]
    kwargs = engine_kwargs("sarathi")
    with LLM(str(tiny_model_dir), **kwargs) as llm:
        want = llm.generate(ps, params)
    with LLM(str(tiny_model_dir), pipeline_stages=2, **kwargs) as llm:
        got = llm.generate(ps, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [len(o.logprobs) for o in got] == [10, 0, 10, 0]
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g.logprobs, w.logprobs, strict=True):
            assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
            assert abs(a.logprob - b.logprob) < 1e-5


@pytest.mark.slow
def test_micro_batches_overlap_under_load(small_model_dir):
    with LLM(str(small_model_dir), pipeline_stages=2, dtype="float32", max_model_len=256,
             kv_cache_tokens=4096, token_budget=64, progress=False) as llm:
        llm.generate(prompts(2000)[:6] * 3, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
        timeline = list(llm.engine.executor.timeline)
        stats = llm.engine.stats()
    # Micro-batch k+1 was handed downstream before micro-batch k's result came back: the stages
    # were working on different micro-batches at the same time.
    overlapping = [b for a, b in itertools.pairwise(timeline) if b[2] < a[3]]
    assert len(overlapping) > len(timeline) // 2
    assert 0.0 < stats.bubble_fraction < 1.0


def process_tree(pid: int) -> list[int]:
    pids = [pid]
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            for child in (task / "children").read_text().split():
                pids += process_tree(int(child))
    return pids


def listening_addresses(pids: list[int]) -> list[str]:
    """Local addresses of the TCP sockets in LISTEN state that these processes hold (from /proc)."""
    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:["):
                        inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.append(fields[1].split(":")[0])
    return found


@pytest.mark.slow
def test_stage_listeners_bind_the_rendezvous_address_only(tiny_model_dir, monkeypatch):
    """The TCPStore and gloo listen on 127.0.0.1 when the group meets there, never on a wildcard."""
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    with LLM(str(tiny_model_dir), pipeline_stages=2, **engine_kwargs("sarathi")) as llm:
        llm.generate(prompts(500)[:2], GREEDY)
        addresses = listening_addresses(process_tree(os.getpid()))
    loopback_v4, loopback_v6 = "0100007F", "00000000000000000000000001000000"
    assert loopback_v4 in addresses or loopback_v6 in addresses
    wildcard = {"00000000", "00000000000000000000000000000000"}
    assert not wildcard & set(addresses), addresses


def run_victim(model_dir: Path, timeout_s: float) -> tuple[subprocess.Popen, list[int]]:
    script = Path(__file__).with_name("pipeline_victim.py")
    proc = subprocess.Popen([sys.executable, str(script), str(model_dir), str(timeout_s)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    pids: list[int] = []
    deadline = time.monotonic() + 120
    for line in proc.stdout:
        if line.startswith("PIDS"):
            pids = [int(x) for x in line.split()[1:]]
        if line.startswith("STREAMING"):
            break
        assert time.monotonic() < deadline
    assert len(pids) == 2, "victim did not report its stage processes"
    return proc, pids


def finish_victim(proc: subprocess.Popen, limit_s: float) -> tuple[int, list[dict], list, float, str]:
    t0 = time.monotonic()
    out, err = proc.communicate(timeout=limit_s)
    elapsed = time.monotonic() - t0
    finished = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    codes = next((json.loads(line.split(" ", 1)[1]) for line in out.splitlines()
                  if line.startswith("CHILD_CODES")), None)
    return proc.returncode, finished, codes, elapsed, err


def pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_dead_or_silent_stage_fails_requests_and_exits(small_model_dir, how):
    timeout_s = 5.0
    proc, (stage1, stage2) = run_victim(small_model_dir, timeout_s)
    try:
        with contextlib.suppress(ProcessLookupError):  # on an overloaded machine it may have timed out already
            os.kill(stage1, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        code, finished, child_codes, elapsed, err = finish_victim(proc, limit_s=60)
    finally:
        proc.kill()
        for pid in (stage1, stage2):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert code == 3, f"stage 0 must fail its requests and exit 3; stderr:\n{err[-3000:]}"
    assert len(finished) == 4
    for req in finished:
        assert req["reason"] == "error" and "pipeline stage" in req["error"]
    # the error says what happened: a killed stage's connection is lost; a frozen one is either
    # silent past the deadline or, if the stage after it gave up first, that stage's connection is lost
    said = ("connection lost",) if how == "killed" else (f"within {timeout_s:.0f}s", "connection lost")
    assert all(any(s in req["error"] for s in said) for req in finished), [req["error"] for req in finished]
    # detection is bounded by the stage timeout (plus the time stage 0 spends on its own work)
    assert elapsed < 4 * timeout_s + 10
    # stage 2 noticed on its own (broken connection or silent upstream) and exited non-zero
    assert child_codes is not None and child_codes[1] not in (0, None)
    deadline = time.monotonic() + 10
    while not (pid_gone(stage1) and pid_gone(stage2)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pid_gone(stage2)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_stage_dying_at_start_up_fails_fast(tiny_model_dir, monkeypatch):
    # Stage 1 asks for a CPU core that does not exist, so it exits before joining the group; stage 0
    # must report that at once rather than wait out the rendezvous timeout.
    monkeypatch.setenv("CHARIOT_STAGE_CPUS", "0+1,4096")
    t0 = time.monotonic()
    with pytest.raises(PipelineError, match="stage 1 exited with code"):
        LLM(str(tiny_model_dir), pipeline_stages=2, dtype="float32", max_model_len=256, kv_cache_tokens=2048,
            block_size=16, progress=False)
    assert time.monotonic() - t0 < 60
