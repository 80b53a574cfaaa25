"""Chariot's router: the gRPC and OpenAI-compatible HTTP front of a deployment.

A deployment is one or more replicas (pipeline groups of stage workers); clients talk to the router,
never to a worker. For every request the router admits it against the SLOs (it predicts the time to
first token on each ready replica from their load reports and sheds with 429 / RESOURCE_EXHAUSTED,
with a retry hint, when no replica can meet it or the tenant's rate limit is spent), balances it onto
the replica with the lowest prediction, and streams the tokens back. Several routers share their
state (token buckets, each replica's admitted load, request → replica) through Redis, and fall back
to local decisions when Redis is unavailable. docs/architecture.md §1 and §5 describe the design.

Where to start reading:
- `app`        — the process: both fronts, the replica watcher and the Stats poller on one event loop;
                 the `chariot router` subcommand;
- `dataplane`  — the one request path both fronts share: count, admit, relay, account, cancel;
- `grpc_front`, `http_front` (+ `openai_api`, the request parsing) — the two fronts;
- `admission`  — the TTFT prediction and the shedding rules, free of any transport;
- `registry`, `upstream` — the replicas, their load reports and their gRPC channels;
- `state`, `ratelimit` — the shared state (in memory or Redis) and the token buckets;
- `config`     — `RouterConfig`, every setting validated once.
"""
