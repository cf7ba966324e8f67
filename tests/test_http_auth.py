"""Bearer-token protection of the trainer status API and serving (``odl.http.auth``)."""

from __future__ import annotations

import http.client
import json
import logging
import os
import socket
import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry

from odl.cli import serve_cli, train_cli
from odl.harness.http_client import http_request
from odl.http.auth import (
    AUTH_TOKEN_ENV,
    MAX_TOKEN_FILE_BYTES,
    AuthConfigError,
    bearer_token,
    is_loopback,
    resolve_auth_token,
    warn_if_exposed,
)
from odl.http.server import BackgroundHttpServer
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
    """GET with an optional token: the status and the JSON (or text) answer."""
    reply = http_request(url, headers={"Authorization": f"{scheme} {token}"}
                         if token is not None else None, timeout=10)
    if reply.status >= 400:
        assert reply.status != 401 or reply.headers.get("www-authenticate", "").startswith(
            "Bearer")
        return reply.status, reply.json()
    body = reply.body.decode()
    return reply.status, json.loads(body) if body.startswith("{") else body


@pytest.fixture
def protected():
    server = BackgroundHttpServer(build_status_app(_Provider(), CollectorRegistry()),
                                  "127.0.0.1", 0, auth_token=TOKEN)
    port = server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.mark.parametrize("path", ["/status", "/offsets", "/metrics", "/history", "/nope"])
def test_every_endpoint_but_healthz_needs_the_token(protected, path):
    code, body = _get(protected + path)
    assert code == 401 and "authorization" in body["detail"]["error"]
    assert _get(protected + path, "wrong")[0] == 401
    assert _get(protected + path, TOKEN[:-1])[0] == 401
    assert _get(protected + path, TOKEN, scheme="Basic")[0] == 401
    assert _get(protected + path, TOKEN)[0] == (404 if path == "/nope" else 200)


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "BeArEr", "Bearer  "])
def test_bearer_scheme_is_case_insensitive(protected, scheme):
    assert _get(protected + "/status", TOKEN, scheme=scheme)[0] == 200
    assert _get(protected + "/status", "wrong", scheme=scheme)[0] == 401


def test_unauthorized_upload_is_refused_before_its_body(protected):
    host, port = protected.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /status HTTP/1.1\r\nHost: x\r\nAuthorization: bearer nope\r\n"
                     b"Content-Length: 200000000\r\n\r\nabc")
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        assert resp.status == 401 and resp.getheader("Connection") == "close"
        resp.read()


def test_bearer_header_parsing():
    assert bearer_token(b"bearer abc") == b"abc"
    assert bearer_token(b"  BEARER\tabc  ") == b"abc"
    for value in (b"Bearerabc", b"Bearer", b"Bearer   ", b"Basic abc", b"", b"abc"):
        assert bearer_token(value) is None, value


def test_healthz_is_open(protected):
    code, body = _get(protected + "/healthz")
    assert code == 200 and body["ok"] is True


def test_dashboard_page_is_open_and_holds_no_figures(protected):
    """``GET /`` is the page's code only: it asks for the token and shows what /status and
    /history answer, which need it."""
    code, page = _get(protected + "/")
    assert code == 200 and page.startswith("<!doctype html>")
    assert 'id="login"' in page and "Authorization" in page
    assert '"training"' not in page  # the provider's state is not in it
    assert _get(protected + "/?x=1", None)[0] == 200


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


def test_token_file_is_read_with_a_cap(tmp_path):
    big = tmp_path / "big"
    big.write_text("t" * (MAX_TOKEN_FILE_BYTES + 1))
    at_cap = tmp_path / "at_cap"
    at_cap.write_text("t" * MAX_TOKEN_FILE_BYTES)
    assert resolve_auth_token(str(at_cap)) == "t" * MAX_TOKEN_FILE_BYTES
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe tok")
    for path, match in ((big, "larger than 4096 bytes"), (tmp_path, "not a regular file"),
                        (binary, "not UTF-8")):
        with pytest.raises(AuthConfigError, match=match):
            resolve_auth_token(str(path))


# Runs in a child with a 3 GiB address-space cap: a reader without a cap would fail there
# with MemoryError on /dev/zero instead of exhausting the test machine, and one that blocks
# on a FIFO runs into the timeout.
_ENDLESS_TOKEN_FILES = r"""
import resource
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
import contextlib, io, json, sys
from odl.cli import serve_cli, train_cli
from odl.http.auth import AuthConfigError, resolve_auth_token
config, fifo = sys.argv[1:3]
out = {}
for path in ("/dev/zero", fifo):
    try:
        resolve_auth_token(path)
        out["resolve " + path] = "accepted"
    except AuthConfigError as exc:
        out["resolve " + path] = str(exc)
    for name, cli, argv in (
            ("odl-serve", serve_cli, ["--export_dir", "x"]),
            ("odl-train", train_cli, ["--pipeline_config_path", config, "--online"])):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = cli.main([*argv, "--log_level", "ERROR", "--auth_token_file", path])
        out[name + " " + path] = [rc, err.getvalue()]
print(json.dumps(out))
"""


def test_clis_refuse_endless_token_files(tmp_path):
    from tests.harness import write_config

    config = write_config(tmp_path, "127.0.0.1:1", "t")
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", _ENDLESS_TOKEN_FILES, config, fifo], cwd=root,
                          capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for path in ("/dev/zero", fifo):
        assert "not a regular file" in out["resolve " + path]
        for name in ("odl-serve", "odl-train"):
            rc, err = out[f"{name} {path}"]
            assert rc == 2, (name, path, err)
            assert err.startswith(f"{name}: --auth_token_file") and "not a regular file" in err
            assert err.count("\n") == 1, err  # one line


@pytest.mark.parametrize("cli, extra", [
    (train_cli, ["--pipeline_config_path", "x.config", "--online"]),
    (serve_cli, ["--export_dir", "x"]),
])
def test_clis_refuse_an_unreadable_token_file(tmp_path, capsys, cli, extra, monkeypatch):
    if cli is train_cli:
        from tests.harness import write_config

        extra = ["--pipeline_config_path", write_config(tmp_path, "127.0.0.1:1", "t"), "--online"]
    rc = cli.main([*extra, "--auth_token_file", str(tmp_path / "missing")])
    err = capsys.readouterr().err
    assert rc == 2 and "--auth_token_file" in err and "Traceback" not in err


def test_loopback_detection_and_loud_warning(caplog):
    for host in ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "10.0.0.5", "example.com", ""):
        assert not is_loopback(host), host
    with caplog.at_level(logging.WARNING, logger="odl.http.auth"):
        assert warn_if_exposed("0.0.0.0", None, "odl-train status API")
        assert not warn_if_exposed("0.0.0.0", TOKEN, "odl-train status API")
        assert not warn_if_exposed("127.0.0.1", None, "odl-train status API")
    assert len(caplog.records) == 1
    assert "WITHOUT authentication" in caplog.records[0].getMessage()
    assert TOKEN not in caplog.text
