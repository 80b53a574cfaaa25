"""Exceptions that cross component boundaries.

Every error a user can cause carries the offending field and, where there is one, the limit, so the
gRPC/HTTP fronts can map it to INVALID_ARGUMENT / 400 without parsing messages.
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


class ConfigError(ChariotError, ValueError):
    """An engine/model configuration value is invalid."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class ModelLoadError(ChariotError):
    """A model directory cannot be loaded (missing files, malformed config, unsupported architecture)."""
