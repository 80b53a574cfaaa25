"""API keys bound to tenants: who may call the router, and as which tenant.

Why: the tenant used to be whatever the caller said (the OpenAI `user` field, an `X-Tenant` header),
so anyone who reached the router could spend another tenant's rate limit or dodge their own. With a
key file (`--api-keys FILE`, or the Secret named by `spec.router.auth.secretName`), every `/v1/*`
HTTP request and every gRPC Generation call must present a key (`Authorization: Bearer <key>`, or
`authorization` metadata), and the key, not the caller, decides the tenant.

The file is YAML:

    keys:
      - key: sk-team-a-...          # or  sha256: <64 hex digits of the key's SHA-256>
        tenant: team-a
        models: ["*"]               # optional allow-list of served model names ("*": any)
        requestsPerMinute: 600      # optional: the tenant's request bucket

Only SHA-256 digests are kept in memory; a presented key is hashed and compared with every stored
digest by `hmac.compare_digest` (constant time, no early exit), so neither timing nor a heap dump
gives a key away. Keys never reach a log line, an error message, a span or a metric label: a
config error names the entry (`keys[2].sha256`), never its value.

`requestsPerMinute` gives the tenant a request bucket (rate `requestsPerMinute / 60` per second,
burst `requestsPerMinute`), in the router's shared state (`SharedState.take`) so that several
routers share it, charged one per request (each `n` > 1 choice is a request) on top of any
`--rate-limit` token bucket of that tenant. Several keys of one tenant share its bucket, so they must
agree on the number.

`KeyStore` polls the file's modification time (like the replica file) and swaps the table when it
changes; a file that no longer parses keeps the previous keys and logs one error per bad version.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from chariot.contracts.errors import AdmissionRejected, AuthenticationError, ConfigError, PermissionDeniedError
from chariot.router.config import TenantLimit

if TYPE_CHECKING:
    from chariot.router.state import SharedState

log = logging.getLogger(__name__)

ANY_MODEL = "*"
BEARER = "bearer"
DIGEST_HEX_CHARS = 64
TENANT_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
ENTRY_FIELDS = frozenset({"key", "sha256", "tenant", "models", "requestsPerMinute"})
REQUEST_BUCKET_PREFIX = "requests:"  # tenants match TENANT_PATTERN, so no token bucket is named like this
MISSING_KEY = "missing API key: send 'Authorization: Bearer <key>'"
UNKNOWN_KEY = "invalid API key"  # never the key itself


@dataclass(frozen=True)
class Principal:
    """Who a request authenticated as: its tenant, the models it may use, its request bucket."""

    tenant: str
    models: tuple[str, ...] = (ANY_MODEL,)
    request_limit: TenantLimit | None = None

    def check_model(self, model: str) -> None:
        """Raise `PermissionDeniedError` (403) unless this key may use `model`."""
        if ANY_MODEL not in self.models and model not in self.models:
            raise PermissionDeniedError("model", f"this API key may not use model {model!r}")


@dataclass(frozen=True)
class KeyTable:
    """The parsed key file: (SHA-256 digest, principal) per key."""

    entries: tuple[tuple[bytes, Principal], ...] = ()

    @property
    def tenants(self) -> frozenset[str]:
        return frozenset(p.tenant for _, p in self.entries)

    def authenticate(self, authorization: str | None) -> Principal:
        """The principal of an `Authorization` value (`Bearer <key>`); `AuthenticationError` otherwise."""
        token = bearer_token(authorization)
        if not token:
            raise AuthenticationError(MISSING_KEY)
        digest = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
        found: Principal | None = None
        for stored, principal in self.entries:  # every entry, no early exit: constant time in the key
            if hmac.compare_digest(stored, digest):
                found = principal
        if found is None:
            raise AuthenticationError(UNKNOWN_KEY)
        return found


def bearer_token(authorization: str | None) -> str:
    """The key of `Bearer <key>` (scheme case-insensitive); empty when absent or another scheme."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    return token.strip() if scheme.lower() == BEARER else ""


def request_limit(requests_per_minute: float) -> TenantLimit:
    """The request bucket of `requestsPerMinute`: that many per minute, a minute's worth of burst."""
    return TenantLimit(rate_per_s=requests_per_minute / 60.0, burst=max(1.0, requests_per_minute))


# ---- parsing ------------------------------------------------------------------------------------


def parse_key_file(text: str) -> KeyTable:
    """The `KeyTable` of a key file's text; `ConfigError` naming the field (never a key's value)."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError("keys", f"is not valid YAML{where}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("keys"), list):
        raise ConfigError("keys", "the file must be a mapping with a 'keys' list")
    entries = tuple(_parse_entry(i, entry) for i, entry in enumerate(doc["keys"]))
    _check_consistent(entries)
    return KeyTable(entries)


def _parse_entry(i: int, entry: Any) -> tuple[bytes, Principal]:
    name = f"keys[{i}]"
    if not isinstance(entry, dict):
        raise ConfigError(name, "must be a mapping with 'key' or 'sha256', and 'tenant'")
    unknown = sorted(str(k) for k in entry if k not in ENTRY_FIELDS)
    if unknown:
        raise ConfigError(f"{name}.{unknown[0]}", f"unknown field; expected {sorted(ENTRY_FIELDS)}")
    tenant = entry.get("tenant")
    if not isinstance(tenant, str) or not TENANT_PATTERN.fullmatch(tenant):
        raise ConfigError(f"{name}.tenant", "is required: 1-63 letters, digits, '.', '_' or '-', starting "
                                            "with a letter or digit")  # fmt: skip
    return _digest(name, entry), Principal(tenant, _models(name, entry), _limit(name, entry))


def _digest(name: str, entry: dict[str, Any]) -> bytes:
    key, hexdigest = entry.get("key"), entry.get("sha256")
    if (key is None) == (hexdigest is None):
        raise ConfigError(name, "needs exactly one of 'key' and 'sha256'")
    if key is not None:
        if not isinstance(key, str) or not key.strip() or key != key.strip() or " " in key:
            raise ConfigError(f"{name}.key", "must be a non-empty string without spaces")
        return hashlib.sha256(key.encode("utf-8")).digest()
    if not isinstance(hexdigest, str) or not re.fullmatch(f"[0-9a-fA-F]{{{DIGEST_HEX_CHARS}}}", hexdigest):
        raise ConfigError(f"{name}.sha256", f"must be {DIGEST_HEX_CHARS} hex digits (the key's SHA-256)")
    return bytes.fromhex(hexdigest)


def _models(name: str, entry: dict[str, Any]) -> tuple[str, ...]:
    models = entry.get("models", [ANY_MODEL])
    if not isinstance(models, list) or not models or not all(isinstance(m, str) and m for m in models):
        raise ConfigError(f"{name}.models", "must be a non-empty list of model names (\"*\": any)")
    return tuple(models)


def _limit(name: str, entry: dict[str, Any]) -> TenantLimit | None:
    rpm = entry.get("requestsPerMinute")
    if rpm is None:
        return None
    if isinstance(rpm, bool) or not isinstance(rpm, int | float) or not math.isfinite(rpm) or rpm <= 0:
        raise ConfigError(f"{name}.requestsPerMinute", "must be a number > 0")
    return request_limit(float(rpm))


def _check_consistent(entries: tuple[tuple[bytes, Principal], ...]) -> None:
    seen: dict[bytes, int] = {}
    limits: dict[str, TenantLimit | None] = {}
    for i, (digest, principal) in enumerate(entries):
        if digest in seen:
            raise ConfigError(f"keys[{i}]", f"is the same key as keys[{seen[digest]}]")
        seen[digest] = i
        if principal.tenant in limits and limits[principal.tenant] != principal.request_limit:
            raise ConfigError(f"keys[{i}].requestsPerMinute",
                              f"differs from another key of tenant {principal.tenant!r} (they share one bucket)")
        limits[principal.tenant] = principal.request_limit


# ---- the watched file ---------------------------------------------------------------------------

_MISSING = (-1, -1, -1)


def file_signature(path: Path) -> tuple[int, int, int]:
    """What changes when the file does, a Secret's atomic symlink swap (new inode) included."""
    try:
        st = path.stat()
    except OSError:
        return _MISSING
    return st.st_mtime_ns, st.st_size, st.st_ino


class KeyStore:
    """The current `KeyTable` of a key file, reloaded when the file changes (see the module docstring)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._signature = file_signature(self.path)
        self._failed: tuple[int, int, int] | None = None
        self.table = self._read("api_keys_file")
        log.info("API keys: %d key(s) for %d tenant(s) from %s", len(self.table.entries), len(self.table.tenants),
                 self.path)

    @property
    def tenants(self) -> frozenset[str]:
        return self.table.tenants

    def authenticate(self, authorization: str | None) -> Principal:
        return self.table.authenticate(authorization)

    def _read(self, field: str) -> KeyTable:
        try:
            return parse_key_file(self.path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(field, f"cannot read {self.path}: {type(exc).__name__}") from None
        except ConfigError as exc:
            raise ConfigError(field, f"{self.path}: {exc}") from None

    def reload_if_changed(self) -> bool:
        """Re-read the file if it changed; True when a new table took effect. Never raises."""
        signature = file_signature(self.path)
        if signature in (self._signature, self._failed):
            return False
        try:
            table = self._read("api_keys_file")
        except ConfigError as exc:
            self._failed = signature
            log.error("API key file rejected, keeping the previous %d key(s): %s", len(self.table.entries), exc)
            return False
        self._signature, self._failed, self.table = signature, None, table
        log.info("API keys reloaded: %d key(s) for %d tenant(s)", len(table.entries), len(table.tenants))
        return True

    async def watch(self, poll_s: float) -> None:
        while True:
            await asyncio.sleep(poll_s)
            self.reload_if_changed()

    def start_watching(self, poll_s: float) -> asyncio.Task[None]:
        return asyncio.get_running_loop().create_task(self.watch(poll_s), name="api-key-file-watch")


# ---- the request bucket -------------------------------------------------------------------------


class RequestLimiter:
    """Charges one request to a key's tenant bucket (`requestsPerMinute`); 429 when it is empty."""

    def __init__(self, state: SharedState, max_retry_after_s: float) -> None:
        self._state = state
        self._max_retry_after_s = max_retry_after_s

    async def acquire(self, principal: Principal | None) -> bool:
        """Take one request; False when the tenant has no bucket. Raises AdmissionRejected("rate_limit")."""
        if principal is None or principal.request_limit is None:
            return False
        result = await self._state.take(REQUEST_BUCKET_PREFIX + principal.tenant, 1.0, principal.request_limit)
        if not result.allowed:
            retry = min(self._max_retry_after_s, max(result.retry_after_s, 0.001))
            raise AdmissionRejected("rate_limit", math.ceil(retry * 1000.0) / 1000.0)
        return True

    async def refund(self, principal: Principal) -> None:
        """Give the request back (it was rejected after it was charged)."""
        if principal.request_limit is not None:
            await self._state.take(REQUEST_BUCKET_PREFIX + principal.tenant, -1.0, principal.request_limit)
