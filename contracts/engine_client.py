"""The one API through which anything serves requests from an engine: `EngineClient`.

Why a protocol of its own: the worker's gRPC server (and any other asyncio front) must not care where
the engine loop runs. Two implementations exist, chosen by the `engine_core` setting:
`chariot.worker.async_engine.AsyncEngine` runs the loop on a thread of the serving process, and
`chariot.worker.engine_core.EngineCoreClient` runs it in a process of its own (so the loop never
waits for the front's GIL). Both stream the same `RequestOutput` deltas with the same guarantees,
which tests check against each other.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Protocol, runtime_checkable

from chariot.contracts.outputs import EngineStats, RequestOutput
from chariot.contracts.requests import Prompt
from chariot.contracts.sampling_params import SamplingParams


@runtime_checkable
class EngineClient(Protocol):
    """An engine loop seen from an asyncio caller.

    Lifecycle: `start()`, then `await wait_ready()` (re-raises a load error), then any number of
    `generate`/`abort`/`stats` calls, finally `await shutdown()` (live requests end with ABORT).
    `failed` is set, and `wait_failed()` resolves, when the engine dies (load error, a crash of its
    loop, a pipeline stage failure or the loss of its process); streams in flight then end with
    `EngineDeadError`.
    """

    def start(self) -> None:
        """Start the engine loop; it builds the engine (loads the model) first."""

    async def wait_ready(self) -> None:
        """Return once the engine is loaded; re-raises the load error if loading failed."""

    @property
    def ready(self) -> bool:
        """True once the engine has loaded."""

    @property
    def max_model_len(self) -> int:
        """The longest prompt plus output the engine accepts."""

    @property
    def failed(self) -> str | None:
        """Why the engine died, or None while it is healthy."""

    async def wait_failed(self) -> str:
        """Resolve with the failure message when the engine dies (never, if it does not)."""

    def generate(
        self, prompt: Prompt, params: SamplingParams, request_id: str | None = None
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream a request's deltas, one per engine step that changed it; the last is `finished`.

        Validation errors (`InvalidRequestError`, `EngineDeadError`) are raised before the first item.
        A consumer that stops early (closes or cancels the iteration) aborts the request, which frees
        its KV blocks.
        """

    async def abort(self, request_id: str) -> RequestOutput | None:
        """Abort a live request (its stream ends with FinishReason.ABORT); None if it is not live."""

    async def stats(self) -> EngineStats:
        """The engine's latest load report (never waits for an iteration to finish)."""

    async def shutdown(self) -> None:
        """Stop the loop: live requests end with FinishReason.ABORT; then the engine is released."""
