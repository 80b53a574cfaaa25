"""TLS on the router's fronts, with certificates that are renewed without a restart.

Why reload: cert-manager renews a certificate by rewriting the Secret (`tls.crt`, `tls.key`) that
the pod mounts, typically every few weeks; a router that read it once would serve an expired
certificate until someone restarted it. Both fronts pick the new files up on their own:

- gRPC: `grpc.dynamic_ssl_server_credentials` asks `CertificateFiles.grpc_fetcher` for a new
  configuration on each handshake; it answers one only when the files changed (a `stat` per
  handshake) and parse;
- HTTP: uvicorn serves one `ssl.SSLContext`; `CertificateFiles.watch_context` polls the files and
  calls `load_cert_chain` on that same context, which new connections then use.

A pair that does not load (a half-written Secret, a key that does not match its certificate) keeps
the previous one, with one error logged per bad version; at start-up it is a `ConfigError`.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import threading
from collections.abc import Callable
from pathlib import Path

import grpc

from chariot.contracts.errors import ConfigError
from chariot.router.auth import file_signature

log = logging.getLogger(__name__)

Signature = tuple[tuple[int, int, int], tuple[int, int, int]]


class CertificateFiles:
    """A PEM certificate chain and its private key on disk, as both fronts serve them."""

    def __init__(self, cert_file: str | Path, key_file: str | Path) -> None:
        self.cert_file, self.key_file = Path(cert_file), Path(key_file)
        self._lock = threading.Lock()  # the gRPC fetcher runs on gRPC's own threads

    def signature(self) -> Signature:
        return file_signature(self.cert_file), file_signature(self.key_file)

    def read(self) -> tuple[bytes, bytes]:
        """(certificate chain, private key) as PEM bytes, checked by loading them into a context."""
        try:
            cert, key = self.cert_file.read_bytes(), self.key_file.read_bytes()
        except OSError as exc:
            raise ConfigError("tls_cert_file", f"cannot read the certificate or key: {exc}") from None
        self._load_into(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER))
        return cert, key

    def _load_into(self, context: ssl.SSLContext) -> None:
        try:
            context.load_cert_chain(str(self.cert_file), str(self.key_file))
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError("tls_cert_file", f"{self.cert_file} and {self.key_file} do not load as a "
                                               f"certificate chain and its key: {exc}") from None  # fmt: skip

    # HTTP -----------------------------------------------------------------------------------------

    def server_context(self) -> ssl.SSLContext:
        """A TLS server context serving the files (TLS 1.2 or newer); `ConfigError` if they do not load."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        self._load_into(context)
        return context

    async def watch_context(self, context: ssl.SSLContext, poll_s: float) -> None:
        """Reload `context`'s certificate whenever the files change (new connections get it)."""
        current, failed = self.signature(), None
        while True:
            await asyncio.sleep(poll_s)
            signature = self.signature()
            if signature in (current, failed):
                continue
            try:
                self._load_into(context)
            except ConfigError as exc:
                failed = signature
                log.error("TLS certificate rejected, the HTTP front keeps the previous one: %s", exc)
                continue
            current, failed = signature, None
            log.info("TLS certificate reloaded for the HTTP front from %s", self.cert_file)

    # gRPC -----------------------------------------------------------------------------------------

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """Server credentials that pick up changed files at the next handshake."""
        cert, key = self.read()
        return grpc.dynamic_ssl_server_credentials(
            grpc.ssl_server_certificate_configuration([(key, cert)]), self.grpc_fetcher(self.signature())
        )

    def grpc_fetcher(self, loaded: Signature) -> Callable[[], grpc.ServerCertificateConfiguration | None]:
        """gRPC's certificate-configuration fetcher: a new configuration only when the files changed."""
        state = {"current": loaded, "failed": None}

        def fetch() -> grpc.ServerCertificateConfiguration | None:
            with self._lock:
                signature = self.signature()
                if signature in (state["current"], state["failed"]):
                    return None
                try:
                    cert, key = self.read()
                except ConfigError as exc:
                    state["failed"] = signature
                    log.error("TLS certificate rejected, the gRPC front keeps the previous one: %s", exc)
                    return None
                state["current"] = signature
                log.info("TLS certificate reloaded for the gRPC front from %s", self.cert_file)
                return grpc.ssl_server_certificate_configuration([(key, cert)])

        return fetch
