"""`chariot up` on CUDA, end to end: wait for its ready line, time four completions, stop it.

    python -m chariot.bench.experiments.gpu_serve_smoke MODEL_DIR STAGES [extra chariot up flags]

Requests 0 and 1 have 401-token prompts, 2 and 3 81-token ones; each asks for 64 greedy tokens.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

READY_WITHIN_S = 150


def wait_ready(proc: subprocess.Popen[str], start: float) -> tuple[bool, list[str]]:
    lines: list[str] = []
    assert proc.stdout is not None
    while time.time() - start < READY_WITHIN_S:
        line = proc.stdout.readline()
        if not line:
            return False, lines
        lines.append(line)
        if "chariot up ready" in line:
            return True, lines
    return False, lines


def complete(model: str, repeat: int) -> str:
    body = json.dumps({"model": model, "prompt": "Hello there, tell me a story " * repeat, "max_tokens": 64,
                       "temperature": 0, "ignore_eos": True}).encode()
    request = urllib.request.Request("http://127.0.0.1:18080/v1/completions", body,
                                     {"Content-Type": "application/json"})
    start = time.time()
    with urllib.request.urlopen(request, timeout=60) as reply:
        usage = json.loads(reply.read()).get("usage")
    return f"{time.time() - start:.3f} s, usage {usage}"


def main(model: str, stages: str, extra: list[str]) -> None:
    cmd = ["chariot", "up", "--model", model, "--device", "cuda", "--dtype", "bfloat16", "--stages", stages,
           "--http-port", "18080", "--grpc-port", "18081", "--kv-cache-tokens", "32768", *extra]
    start = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    ready, lines = wait_ready(proc, start)
    print(f"stages={stages}: ready={ready} after {time.time() - start:.1f} s", flush=True)
    if ready:
        for i in range(4):
            print(f"request {i}: {complete(Path(model).name, 40 if i < 2 else 8)}", flush=True)
    os.killpg(proc.pid, signal.SIGINT)
    try:
        rest, _ = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        rest, _ = proc.communicate()
    print("exit", proc.returncode)
    print(("".join(lines[-25:]) if not ready else "") + (rest or "")[-4000:])


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
