"""A small gRPC client for `chariot generate`: streams one completion from a router or worker."""

from __future__ import annotations

import sys

import grpc

from chariot.contracts.proto_codec import finish_reason_from_proto, request_to_proto
from chariot.contracts.sampling_params import SamplingParams
from chariot.proto.chariot.v1 import generation_pb2_grpc


def stream_completion(target: str, prompt: str, params: SamplingParams, timeout_s: float = 600.0) -> int:
    """Print the prompt and the streamed completion; returns a process exit code."""
    with grpc.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        print(prompt, end="", flush=True)
        try:
            for resp in stub.Generate(request_to_proto(prompt, params), timeout=timeout_s):
                print(resp.text, end="", flush=True)
                reason = finish_reason_from_proto(resp.finish_reason)
                if reason is not None:
                    print(f"\n[{resp.completion_tokens} tokens, finish={reason.value}]", file=sys.stderr)
        except grpc.RpcError as err:
            print(f"\nchariot generate: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    return 0
