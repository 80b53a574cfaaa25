"""Stage 0 of a 3-stage local pipeline used by the failure tests (run as a subprocess).

Prints `PIDS <pid of stage 1> <pid of stage 2>` once the pipeline is up, then one JSON line per
finished request, and exits with the engine's verdict: 0 if all finished normally, 3 if the engine
failed (a stage died or stopped answering).
"""

from __future__ import annotations

import json
import os
import sys

from chariot.worker import LLM, SamplingParams


def main(model_dir: str, timeout_s: float) -> int:
    llm = LLM(model_dir, dtype="float32", max_model_len=256, kv_cache_tokens=4096, pipeline_stages=3,
              stage_timeout_s=timeout_s, progress=False)
    assert llm.pipeline is not None
    print("PIDS", *llm.pipeline.pids, flush=True)
    engine = llm.engine
    for i in range(4):
        engine.add_request([5 + i] * 30, SamplingParams(max_tokens=200, ignore_eos=True, temperature=0.0))
    while engine.has_unfinished:
        for out in engine.step().outputs:
            if out.finish_reason is not None:
                print(json.dumps({"id": out.request_id, "reason": out.finish_reason.value, "error": out.error,
                                  "tokens": out.num_output_tokens}), flush=True)
            elif out.num_output_tokens == 5:
                print("STREAMING", flush=True)
    if engine.failed is not None:
        print("FAILED", engine.failed, flush=True)
        codes = llm.pipeline.stop(timeout=3 * timeout_s)  # downstream stages must exit on their own
        print("CHILD_CODES", json.dumps(codes), flush=True)
        # Leave without interpreter finalization: tearing down a gloo group whose peer died can abort
        # the process ("terminate called without an active exception", seen once in CI), which would
        # hide the exit code this test checks. What it checks has all been printed by now.
        os._exit(3)
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], float(sys.argv[2])))
