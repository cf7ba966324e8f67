"""Bearer-token protection of the trainer status API and serving (``odl.http_auth``)."""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from odl.cli import serve_cli, train_cli
from odl.http_auth import (
    AUTH_TOKEN_ENV,
    AuthConfigError,
    is_loopback,
    resolve_auth_token,
    warn_if_exposed,
)
from odl.http_server import BackgroundHttpServer
from odl.train.status_app import build_status_app

TOKEN = "tok-8f1c2e7a93b4"


class _Provider:
    def status(self) -> dict:
        return {"state": "training"}

    def offsets(self) -> dict:
        return {"positions": {}}

    def health(self) -> tuple[bool, str]:
        return True, "training"


def _get(url: str, token: str | None = None, scheme: str = "Bearer") -> tuple[int, dict | str]:
    req = urllib.request.Request(url)
    if token is not None:
        req.add_header("Authorization", f"{scheme} {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read().decode()
            return r.status, json.loads(body) if body.startswith("{") else body
    except urllib.error.HTTPError as e:
        assert e.code != 401 or e.headers.get("WWW-Authenticate", "").startswith("Bearer")
        return e.code, json.loads(e.read())


@pytest.fixture
def protected():
    server = BackgroundHttpServer(build_status_app(_Provider(), CollectorRegistry()),
                                  "127.0.0.1", 0, auth_token=TOKEN)
    port = server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.mark.parametrize("path", ["/status", "/offsets", "/metrics", "/nope"])
def test_every_endpoint_but_healthz_needs_the_token(protected, path):
    code, body = _get(protected + path)
    assert code == 401 and "authorization" in body["detail"]["error"]
    assert _get(protected + path, "wrong")[0] == 401
    assert _get(protected + path, TOKEN[:-1])[0] == 401
    assert _get(protected + path, TOKEN, scheme="Basic")[0] == 401
    assert _get(protected + path, TOKEN)[0] == (404 if path == "/nope" else 200)


def test_healthz_is_open(protected):
    code, body = _get(protected + "/healthz")
    assert code == 200 and body["ok"] is True


def test_no_token_means_open():
    server = BackgroundHttpServer(build_status_app(_Provider(), CollectorRegistry()))
    port = server.start()
    try:
        assert _get(f"http://127.0.0.1:{port}/status")[0] == 200
    finally:
        server.stop()


def test_token_from_file_or_env(tmp_path):
    f = tmp_path / "token"
    f.write_text(f"  {TOKEN}\n")
    assert resolve_auth_token(str(f), environ={AUTH_TOKEN_ENV: "other"}) == TOKEN
    assert resolve_auth_token(None, environ={AUTH_TOKEN_ENV: " env-tok "}) == "env-tok"
    assert resolve_auth_token(None, environ={}) is None
    assert resolve_auth_token(None, environ={AUTH_TOKEN_ENV: "  "}) is None
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(AuthConfigError, match="empty"):
        resolve_auth_token(str(tmp_path / "empty"))
    with pytest.raises(AuthConfigError, match="cannot read"):
        resolve_auth_token(str(tmp_path / "missing"))


@pytest.mark.parametrize("cli, extra", [
    (train_cli, ["--pipeline_config_path", "x.config", "--online"]),
    (serve_cli, ["--export_dir", "x"]),
])
def test_clis_refuse_an_unreadable_token_file(tmp_path, capsys, cli, extra, monkeypatch):
    if cli is train_cli:
        from tests.online_harness import write_config

        extra = ["--pipeline_config_path", write_config(tmp_path, "127.0.0.1:1", "t"), "--online"]
    rc = cli.main([*extra, "--auth_token_file", str(tmp_path / "missing")])
    err = capsys.readouterr().err
    assert rc == 2 and "--auth_token_file" in err and "Traceback" not in err


def test_loopback_detection_and_loud_warning(caplog):
    for host in ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "10.0.0.5", "example.com", ""):
        assert not is_loopback(host), host
    with caplog.at_level(logging.WARNING, logger="odl.http_auth"):
        assert warn_if_exposed("0.0.0.0", None, "odl-train status API")
        assert not warn_if_exposed("0.0.0.0", TOKEN, "odl-train status API")
        assert not warn_if_exposed("127.0.0.1", None, "odl-train status API")
    assert len(caplog.records) == 1
    assert "WITHOUT authentication" in caplog.records[0].getMessage()
    assert TOKEN not in caplog.text
