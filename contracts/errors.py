"""Exceptions that cross component boundaries.

Every error a user can cause carries the offending field and, where there is one, the limit, so the
gRPC/HTTP fronts can map it to INVALID_ARGUMENT / 400 without parsing messages. Each one pickles with
its fields (`__reduce__`), since errors cross from the engine-core process to the front.
"""

from __future__ import annotations


class ChariotError(Exception):
    """Base class for errors raised by Chariot itself."""


class InvalidRequestError(ChariotError, ValueError):
    """A request (prompt or sampling parameters) is invalid; nothing was admitted."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return type(self), (self.field, self.message)


class ConfigError(ChariotError, ValueError):
    """An engine/model configuration value is invalid."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return type(self), (self.field, self.message)


class ModelLoadError(ChariotError):
    """A model directory cannot be loaded (missing files, malformed config, unsupported architecture)."""


class PipelineError(ChariotError):
    """A pipeline stage died or stopped answering; the whole group must be restarted.

    The engine fails every live request with FinishReason.ERROR carrying this message, sets
    `Engine.failed`, and refuses new requests; the worker process then exits non-zero.
    """


class EngineDeadError(ChariotError):
    """The engine has failed (see `Engine.failed`) and accepts no more requests."""


class AdmissionRejected(ChariotError):
    """Admission control shed the request (SLO would be missed, queue bound, or tenant rate limit)."""

    def __init__(self, reason: str, retry_after_s: float) -> None:
        super().__init__(f"request shed by admission control ({reason}); retry after {retry_after_s:.1f}s")
        self.reason = reason
        self.retry_after_s = retry_after_s

    def __reduce__(self) -> tuple[type, tuple[str, float]]:
        return type(self), (self.reason, self.retry_after_s)


class AuthenticationError(ChariotError):
    """The request carries no API key, or one the router does not know (the key is never in the message)."""


class PermissionDeniedError(ChariotError):
    """The request's API key is valid but may not use what it asked for (say, a model outside its list)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return type(self), (self.field, self.message)


class NoReplicaAvailable(ChariotError):
    """No ready replica can serve the request; `retry_after_s` (when known) is when to try again,
    e.g. after a request held for a first replica timed out while one is starting."""

    def __init__(self, message: str = "", retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def __reduce__(self) -> tuple[type, tuple[str, float | None]]:
        return type(self), (str(self), self.retry_after_s)


class UnknownModelError(InvalidRequestError):
    """The request names a model this deployment does not serve."""

    def __init__(self, model: str, served: str) -> None:
        super().__init__("model", f"unknown model {model!r}; this server serves {served!r}")
        self.model, self.served = model, served

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return type(self), (self.model, self.served)


# The one error → status mapping (docs/architecture.md §4), used by every gRPC and HTTP front.
# Order matters: the first matching class wins.
_STATUS_TABLE: tuple[tuple[type[BaseException], str, int], ...] = (
    (UnknownModelError, "NOT_FOUND", 404),  # as OpenAI answers an unknown model
    (InvalidRequestError, "INVALID_ARGUMENT", 400),
    (AuthenticationError, "UNAUTHENTICATED", 401),
    (PermissionDeniedError, "PERMISSION_DENIED", 403),
    (AdmissionRejected, "RESOURCE_EXHAUSTED", 429),
    (NoReplicaAvailable, "UNAVAILABLE", 503),
    (EngineDeadError, "UNAVAILABLE", 503),
    (PipelineError, "UNAVAILABLE", 503),
)


def error_status(exc: BaseException) -> tuple[str, int]:
    """(gRPC status code name, HTTP status) for an exception; anything unknown is INTERNAL/500."""
    for cls, grpc_code, http_status in _STATUS_TABLE:
        if isinstance(exc, cls):
            return grpc_code, http_status
    return "INTERNAL", 500
