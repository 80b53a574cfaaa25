"""The API key file (`chariot.router.auth`): parsing errors name the field and never the key, keys
authenticate to their tenant, a reload that fails keeps the previous keys, and the error mapping
gives 401 / UNAUTHENTICATED and 403 / PERMISSION_DENIED."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import pytest

from chariot.contracts.errors import AuthenticationError, ConfigError, PermissionDeniedError, error_status
from chariot.router.auth import KeyStore, Principal, bearer_token, parse_key_file, request_limit
from chariot.router.config import RouterConfig
from chariot.router.openai_api import error_payload

SECRET = "sk-unit-secret-0123456789"


def test_keys_and_digests_authenticate_to_their_tenant() -> None:
    table = parse_key_file(f"""
keys:
  - key: {SECRET}
    tenant: team-a
    requestsPerMinute: 120
  - sha256: {hashlib.sha256(b"sk-other").hexdigest().upper()}
    tenant: team-b
    models: [tiny]
""")
    a = table.authenticate(f"Bearer {SECRET}")
    assert a == Principal("team-a", ("*",), request_limit(120))
    assert a.request_limit is not None and a.request_limit.rate_per_s == 2.0 and a.request_limit.burst == 120
    assert table.authenticate("bearer   sk-other").tenant == "team-b"
    assert table.tenants == {"team-a", "team-b"}
    for bad in (None, "", "Bearer", "Bearer ", "Basic " + SECRET, SECRET, "Bearer sk-wrong", f"Bearer {SECRET}x"):
        with pytest.raises(AuthenticationError) as err:
            table.authenticate(bad)
        assert SECRET not in str(err.value)


def test_a_model_outside_the_list_is_forbidden() -> None:
    Principal("t", ("*",)).check_model("anything")
    Principal("t", ("tiny",)).check_model("tiny")
    with pytest.raises(PermissionDeniedError) as err:
        Principal("t", ("tiny",)).check_model("big")
    assert err.value.field == "model"


@pytest.mark.parametrize(("text", "field"), [
    ("keys: [", "keys"),
    ("{}", "keys"),
    ("keys: [hello]", "keys[0]"),
    (f"keys: [{{key: {SECRET}}}]", "keys[0].tenant"),
    (f"keys: [{{key: {SECRET}, tenant: 'a b'}}]", "keys[0].tenant"),
    ("keys: [{tenant: a}]", "keys[0]"),
    (f"keys: [{{key: {SECRET}, sha256: {'a' * 64}, tenant: a}}]", "keys[0]"),
    (f"keys: [{{sha256: {SECRET}, tenant: a}}]", "keys[0].sha256"),
    (f"keys: [{{sha256: {'g' * 64}, tenant: a}}]", "keys[0].sha256"),
    (f"keys: [{{key: {SECRET}, tenant: a, models: []}}]", "keys[0].models"),
    (f"keys: [{{key: {SECRET}, tenant: a, requestsPerMinute: 0}}]", "keys[0].requestsPerMinute"),
    (f"keys: [{{key: {SECRET}, tenant: a, rpm: 3}}]", "keys[0].rpm"),
    (f"keys: [{{key: {SECRET}, tenant: a}}, {{key: {SECRET}, tenant: b}}]", "keys[1]"),
    (f"keys: [{{key: {SECRET}, tenant: a, requestsPerMinute: 1}}, {{key: k2, tenant: a}}]",
     "keys[1].requestsPerMinute"),
])
def test_config_errors_name_the_field_never_the_key(text: str, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_key_file(text)
    assert err.value.field == field, err.value
    assert SECRET not in str(err.value)


def test_a_failed_reload_keeps_the_previous_keys(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(f"keys: [{{key: {SECRET}, tenant: a}}]")
    store = KeyStore(path)
    assert store.authenticate(f"Bearer {SECRET}").tenant == "a"
    caplog.set_level(logging.INFO)
    path.write_text(f"keys: [{{key: {SECRET}}}]")  # no tenant
    os.utime(path, ns=(1, 1))
    assert not store.reload_if_changed() and not store.reload_if_changed()  # logged once per bad version
    assert store.authenticate(f"Bearer {SECRET}").tenant == "a"
    assert caplog.text.count("keys[0].tenant") == 1 and SECRET not in caplog.text
    path.write_text("keys: [{key: sk-new, tenant: b}]")
    assert store.reload_if_changed()
    with pytest.raises(AuthenticationError):
        store.authenticate(f"Bearer {SECRET}")
    with pytest.raises(ConfigError) as err:
        KeyStore(tmp_path / "missing.yaml")
    assert err.value.field == "api_keys_file"


def test_bearer_token() -> None:
    assert bearer_token("Bearer abc") == "abc" and bearer_token("BEARER  abc ") == "abc"
    assert bearer_token("Token abc") == "" and bearer_token(None) == ""


def test_error_mapping_and_openai_body() -> None:
    assert error_status(AuthenticationError("invalid API key")) == ("UNAUTHENTICATED", 401)
    assert error_status(PermissionDeniedError("model", "no")) == ("PERMISSION_DENIED", 403)
    status, body, headers = error_payload(AuthenticationError("invalid API key"))
    assert status == 401 and body["error"]["type"] == "authentication_error" and "WWW-Authenticate" in headers
    status, body, _ = error_payload(PermissionDeniedError("model", "no"))
    assert status == 403 and body["error"]["param"] == "model" and body["error"]["code"] == "permission_denied"


def test_tls_files_come_in_pairs() -> None:
    with pytest.raises(ConfigError) as err:
        RouterConfig(tls_cert_file="tls.crt")
    assert err.value.field == "tls_key_file"
    with pytest.raises(ConfigError) as err:
        RouterConfig(secret_poll_s=0)
    assert err.value.field == "secret_poll_s"


def test_chariot_up_passes_the_security_flags_to_the_router() -> None:
    import argparse

    from chariot.router.app import add_router_parser, config_from_args
    from chariot.router.launch import add_security_flags, security_args

    up = argparse.ArgumentParser()
    add_security_flags(up)
    args = up.parse_args(["--api-keys", "k.yaml", "--tls-cert", "c.pem", "--tls-key", "k.pem"])
    passed = security_args(args)
    assert passed == ["--api-keys", "k.yaml", "--tls-cert", "c.pem", "--tls-key", "k.pem"]
    assert security_args(up.parse_args([])) == []
    parser = argparse.ArgumentParser()
    add_router_parser(parser.add_subparsers(dest="command"))
    config = config_from_args(parser.parse_args(["router", *passed]))
    assert (config.api_keys_file, config.tls_cert_file, config.tls_key_file) == ("k.yaml", "c.pem", "k.pem")
