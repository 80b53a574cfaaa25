"""API keys bound to tenants, and TLS, on the real router (`run_router`, both fronts) over a real
worker (tiny checkpoint, CPU), with the official `openai` SDK on the HTTP front and gRPC stubs.

Each test starts its own router (fresh in-memory buckets) on the module's one worker; the key file is
rewritten in place to test reloading, and a test CA made here (`cryptography`) signs the certificates.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import logging
import os
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chariot.contracts.proto_codec import request_to_proto
from chariot.contracts.sampling_params import SamplingParams
from chariot.proto.chariot.v1 import generation_pb2 as pb
from chariot.proto.chariot.v1 import generation_pb2_grpc as pb_grpc
from chariot.router.config import RouterConfig
from tests.integration.test_router import (
    RUN_ROUTER_COMMAND,
    SERVED,
    TIMEOUT,
    Router,
    Worker,
    wait_for,
)

KEY_A = "sk-team-a-0123456789abcdef"
KEY_B = "sk-team-b-fedcba9876543210"  # stored as its sha256 only
KEY_C = "sk-team-c-only-another-model"
KEY_NEW = "sk-added-later-5555555555"
ALL_KEYS = (KEY_A, KEY_B, KEY_C, KEY_NEW)
POLL_S = 0.1
TWO_TOKENS = SamplingParams(max_tokens=2, temperature=0.0)


def sha256(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def key_file(path: Path, *entries: str) -> Path:
    """Write a key file atomically (a new inode, like a Secret's symlink swap) and return its path."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text("keys:\n" + "".join(entries), encoding="utf-8")
    os.replace(tmp, path)
    return path


ENTRY_A = f"  - key: {KEY_A}\n    tenant: team-a\n    requestsPerMinute: 2\n"
ENTRY_B = f"  - sha256: {sha256(KEY_B)}\n    tenant: team-b\n    models: ['*']\n    requestsPerMinute: 1\n"
ENTRY_C = f"  - key: {KEY_C}\n    tenant: team-c\n    models: [another-model]\n"
ENTRY_NEW = f"  - key: {KEY_NEW}\n    tenant: team-new\n"


@pytest.fixture(scope="module")
def worker(tiny_model_dir: Path) -> Iterator[Worker]:
    w = Worker(tiny_model_dir, "g0")
    yield w
    w.stop()


def start_router(worker: Worker, keys: Path | None, **config: Any) -> Router:
    r = Router([worker.flag], RouterConfig(ttft_slo_ms=60_000, api_keys_file=str(keys) if keys else None,
                                           secret_poll_s=POLL_S, **config))
    return r


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    return key_file(tmp_path / "keys.yaml", ENTRY_A, ENTRY_B, ENTRY_C)


@pytest.fixture
def router(worker: Worker, keys: Path) -> Iterator[Router]:
    r = start_router(worker, keys)
    wait_for(lambda: r.health()["ready_replicas"] >= 1, what="a ready replica")
    yield r
    r.stop()


def sdk(router: Router, key: str, **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(api_key=key, base_url=f"{router.url}/v1", max_retries=0, timeout=TIMEOUT, **kw)


def complete(client: openai.OpenAI, **kw: Any) -> Any:
    return client.completions.create(model=SERVED, prompt="hello", max_tokens=2, **kw)


# ---- HTTP --------------------------------------------------------------------------------------------


def test_http_keys_decide_who_may_call_and_as_which_tenant(router: Router, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    # No key: 401 with an OpenAI-style body (the SDK always sends one, so use plain HTTP here).
    resp = router.client.post("/v1/completions", json={"model": SERVED, "prompt": "hi", "max_tokens": 2})
    assert resp.status_code == 401 and resp.headers["www-authenticate"].startswith("Bearer")
    assert resp.json()["error"]["code"] == "invalid_api_key"
    assert router.client.get("/v1/models").status_code == 401
    # A wrong key: 401 through the SDK.
    with pytest.raises(openai.AuthenticationError) as wrong:
        complete(sdk(router, "sk-wrong"))
    assert wrong.value.status_code == 401 and "sk-wrong" not in str(wrong.value)
    # Probes and scraping stay open.
    assert router.client.get("/health").status_code == 200
    assert router.client.get("/health/live").status_code == 200
    assert router.client.get("/metrics").status_code == 200
    # A valid key: 200, within its tenant's limit (team-a: 2 requests a minute), then 429.
    team_a = sdk(router, KEY_A)
    assert complete(team_a).choices[0].finish_reason == "length"
    assert [m.id for m in team_a.models.list().data] == [SERVED]
    assert complete(team_a).usage.completion_tokens == 2
    with pytest.raises(openai.RateLimitError):
        complete(team_a)
    # A model outside the key's list: 403 (and /v1/models lists nothing for it).
    team_c = sdk(router, KEY_C)
    with pytest.raises(openai.PermissionDeniedError) as denied:
        complete(team_c)
    assert denied.value.status_code == 403
    assert team_c.models.list().data == []


def test_a_spoofed_tenant_spends_its_own_keys_bucket(router: Router) -> None:
    # team-b (1 request a minute) names team-a in X-Tenant and `user`: the key decides, so team-b's
    # bucket pays and team-a's two requests are still there.
    team_b = sdk(router, KEY_B, default_headers={"X-Tenant": "team-a"})
    assert complete(team_b, user="team-a").choices
    with pytest.raises(openai.RateLimitError):
        complete(team_b, user="team-a")
    team_a = sdk(router, KEY_A)
    assert complete(team_a).choices and complete(team_a).choices
    with pytest.raises(openai.RateLimitError):
        complete(team_a)
    metrics = router.client.get("/metrics").text
    admitted = [line for line in metrics.splitlines() if line.startswith("chariot_tenant_requests_total")]
    assert any('tenant="team-a"' in line and line.endswith(" 2.0") for line in admitted), admitted
    assert any('tenant="team-b"' in line and line.endswith(" 1.0") for line in admitted), admitted
    rejected = [line for line in metrics.splitlines() if line.startswith("chariot_tenant_rejections_total")]
    assert any('reason="rate_limit"' in line and 'tenant="team-b"' in line for line in rejected), rejected
    assert any('tenant="team-a"' in line and "gen_ai_token_type" in line for line in metrics.splitlines()
               if line.startswith("chariot_tenant_tokens_total"))


def test_tenant_labels_stay_bounded_and_no_keys_warns(worker: Worker, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    r = start_router(worker, None)  # no keys: callers name their tenant, unknown ones are labelled "other"
    try:
        wait_for(lambda: r.health()["ready_replicas"] >= 1, what="a ready replica")
        for i in range(3):
            resp = r.post("/v1/completions", {"prompt": "hi", "max_tokens": 1}, headers={"X-Tenant": f"made-up-{i}"})
            assert resp.status_code == 200, resp.text
        metrics = r.client.get("/metrics").text
        assert "made-up" not in metrics and 'tenant="other"' in metrics
        assert "no API keys configured" in caplog.text
    finally:
        r.stop()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=st.one_of(
    st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=255, exclude_characters="\x7f"), max_size=300),
    st.builds(lambda k, s: f"{s}{k}", st.sampled_from(["Bearer ", "bearer  ", "Basic ", "Bearer\t", ""]),
              st.sampled_from([KEY_A, KEY_A[:-1], KEY_A + "x", KEY_A.upper(), " " + KEY_A, "", "\x00"]))))
def test_fuzzed_authorization_headers_never_5xx(router: Router, value: str) -> None:
    try:
        resp = router.client.post("/v1/completions", json={"model": SERVED, "prompt": "hi", "max_tokens": 1},
                                  headers={"Authorization": value.encode("latin-1")})
    except httpx.LocalProtocolError:  # a header value h11 itself refuses to send
        return
    assert resp.status_code < 500, (resp.status_code, resp.text)
    assert resp.status_code in (200, 401, 429), resp.text


# ---- gRPC --------------------------------------------------------------------------------------------


def generate(router: Router, key: str | None, *, tenant: str = "", model: str = SERVED) -> list[Any]:
    metadata = (("authorization", f"Bearer {key}"),) if key is not None else None
    req = request_to_proto("hello", TWO_TOKENS, model=model, tenant=tenant)
    return list(router.stub.Generate(req, metadata=metadata, timeout=TIMEOUT))


def grpc_code(call: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


def test_grpc_keys_the_same_way(router: Router) -> None:
    assert grpc_code(lambda: generate(router, None)) == grpc.StatusCode.UNAUTHENTICATED
    assert grpc_code(lambda: generate(router, "sk-wrong")) == grpc.StatusCode.UNAUTHENTICATED
    assert grpc_code(lambda: router.stub.Stats(pb.StatsRequest(), timeout=TIMEOUT)) == grpc.StatusCode.UNAUTHENTICATED
    assert router.stub.Stats(pb.StatsRequest(), metadata=(("authorization", f"Bearer {KEY_A}"),), timeout=TIMEOUT)
    assert grpc_code(lambda: generate(router, KEY_C)) == grpc.StatusCode.PERMISSION_DENIED
    # team-b (1 a minute) spoofing team-a in the tenant field spends team-b's bucket.
    assert generate(router, KEY_B, tenant="team-a")[-1].finish_reason
    assert grpc_code(lambda: generate(router, KEY_B, tenant="team-a")) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert generate(router, KEY_A) and generate(router, KEY_A)
    assert grpc_code(lambda: generate(router, KEY_A)) == grpc.StatusCode.RESOURCE_EXHAUSTED


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=200))
def test_fuzzed_grpc_authorization_metadata_is_unauthenticated_never_internal(router: Router, value: str) -> None:
    req = request_to_proto("hello", TWO_TOKENS, model=SERVED)
    try:
        list(router.stub.Generate(req, metadata=(("authorization", value),), timeout=TIMEOUT))
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED, (value, err.code())
    else:
        raise AssertionError(f"{value!r} was accepted")


# ---- reloading ---------------------------------------------------------------------------------------


def accepted(router: Router, key: str) -> bool:
    resp = router.client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
    assert resp.status_code in (200, 401), resp.text
    return resp.status_code == 200


def test_keys_added_and_removed_take_effect_without_a_restart(
    router: Router, keys: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    assert accepted(router, KEY_A) and not accepted(router, KEY_NEW)
    key_file(keys, ENTRY_NEW, ENTRY_B)  # KEY_NEW added, KEY_A removed
    wait_for(lambda: accepted(router, KEY_NEW), timeout=10, what="the added key accepted")
    assert not accepted(router, KEY_A)
    assert complete(sdk(router, KEY_NEW)).choices
    assert grpc_code(lambda: generate(router, KEY_A)) == grpc.StatusCode.UNAUTHENTICATED
    # A broken file keeps the previous keys, with one error naming the field (never a key).
    key_file(keys, ENTRY_NEW, f"  - sha256: not-hex-{KEY_A}\n    tenant: team-a\n")
    wait_for(lambda: "keys[1].sha256" in caplog.text, timeout=10, what="the reload error logged")
    assert accepted(router, KEY_NEW) and not accepted(router, KEY_A)
    assert not any(k in caplog.text for k in ALL_KEYS), "a key reached the logs"


# ---- TLS ---------------------------------------------------------------------------------------------


def make_ca(name: str) -> tuple[Any, Any]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def issue(ca: tuple[Any, Any], cert_file: Path, key_file_: Path) -> None:
    """A server certificate for localhost / 127.0.0.1 signed by `ca`, written as tls.crt / tls.key."""
    ca_key, ca_cert = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    san = x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "router")]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(san, critical=False).sign(ca_key, hashes.SHA256()))
    pem_key = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    for path, data in ((key_file_, pem_key), (cert_file, cert.public_bytes(serialization.Encoding.PEM))):
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)


def pem(ca: tuple[Any, Any]) -> bytes:
    return bytes(ca[1].public_bytes(serialization.Encoding.PEM))


def test_tls_on_both_fronts_with_a_test_ca_and_a_renewed_certificate(
    worker: Worker, keys: Path, tmp_path: Path
) -> None:
    ca1, ca2 = make_ca("test-ca-1"), make_ca("test-ca-2")
    crt, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    issue(ca1, crt, key)
    r = start_router(worker, keys, tls_cert_file=str(crt), tls_key_file=str(key))
    try:
        https = f"https://127.0.0.1:{r.http_port}"

        def sdk_call(ca: tuple[Any, Any]) -> Any:
            context = ssl.create_default_context(cadata=pem(ca).decode())
            with httpx.Client(verify=context, timeout=TIMEOUT) as http:
                client = openai.OpenAI(api_key=KEY_A, base_url=f"{https}/v1", max_retries=0,
                                       http_client=http)
                return client.models.list()

        wait_for(lambda: httpx.get(f"{https}/health", verify=ssl.create_default_context(cadata=pem(ca1).decode()))
                 .status_code == 200, what="a ready replica over TLS")
        assert [m.id for m in sdk_call(ca1).data] == [SERVED]
        with pytest.raises(openai.APIConnectionError):
            sdk_call(ca2)  # not trusted
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{r.http_port}/health", timeout=5).raise_for_status()  # no plaintext
        grpc_generate = tls_generate(r.grpc_port, pem(ca1))
        assert grpc_generate(KEY_A)[-1].finish_reason
        # The certificate is renewed (by another CA, so the test can tell): new connections get it.
        issue(ca2, crt, key)
        wait_for(lambda: _verifies(https, ca2), timeout=10, what="the HTTP front serving the renewed certificate")
        assert tls_generate(r.grpc_port, pem(ca2))(KEY_A)[-1].finish_reason
    finally:
        r.stop()


def _verifies(url: str, ca: tuple[Any, Any]) -> bool:
    try:
        return httpx.get(f"{url}/health/live", verify=ssl.create_default_context(cadata=pem(ca).decode()),
                         timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def tls_generate(port: int, root: bytes) -> Any:
    def call(key: str) -> list[Any]:
        with grpc.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials(root_certificates=root)) as ch:
            req = request_to_proto("hello", TWO_TOKENS, model=SERVED)
            stub = pb_grpc.GenerationStub(ch)
            return list(stub.Generate(req, metadata=(("authorization", f"Bearer {key}"),), timeout=TIMEOUT))

    return call


# ---- the command ---------------------------------------------------------------------------------------


def test_the_router_command_never_logs_keys_and_refuses_a_bad_key_file(
    worker: Worker, keys: Path, tmp_path: Path
) -> None:
    argv = [sys.executable, "-c", RUN_ROUTER_COMMAND, "router", "--http-port", "0", "--grpc-port", "0",
            "--replica", worker.flag, "--served-model-name", SERVED, "--api-keys", str(keys)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        http_port = int(line.split(" ")[3].split(":")[1])
        with httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=TIMEOUT) as client:
            wait_for(lambda: client.get("/health").status_code == 200, what="router health")
            for key in (*ALL_KEYS, "sk-wrong"):
                client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                            headers={"Authorization": f"Bearer {key}"})
            key_file(keys, f"  - key: {KEY_NEW}\n")  # a reload error: no tenant
            time.sleep(2.5)  # the default poll interval (2 s) and then some
            assert client.get("/health").status_code == 200
            metrics = client.get("/metrics").text
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    assert proc.returncode == 0, stderr
    assert not any(k in stderr or k in metrics for k in ALL_KEYS), "a key reached the logs or the metrics"

    key_file(keys, f"  - sha256: {'z' * 64}\n    tenant: team-a\n")
    bad = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT)
    assert bad.returncode == 2 and "keys[0].sha256" in bad.stderr, bad.stderr
    assert "keys[0].tenant" in stderr  # the reload error named the field
