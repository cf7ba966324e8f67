"""The systemd units: required keys, hardening, flags the CLIs know, and systemd's own check."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from odl.cli import serve_cli, train_cli
from tests.harness import REPO

UNITS = Path(REPO) / "systemd"
TRAIN = UNITS / "odl-train@.service"
SERVE = UNITS / "odl-serve@.service"
ENV_EXAMPLE = UNITS / "odl.env.example"
RANKS = UNITS / "odl-train-ranks.conf"
HOSTS = UNITS / "odl-train-hosts.conf"


def parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """``{section: {key: [values in order]}}`` (systemd keys may repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        assert not line.endswith("\\"), f"{path}:{lineno}: keep every setting on one line"
        m = re.fullmatch(r"\[(\w+)\]", line)
        if m:
            current = sections.setdefault(m.group(1), {})
            continue
        assert current is not None, f"{path}:{lineno}: setting outside a section"
        key, sep, value = line.partition("=")
        assert sep and re.fullmatch(r"[A-Za-z]+", key.strip()), f"{path}:{lineno}: {line!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def _one(unit: dict, section: str, key: str) -> str:
    values = unit[section].get(key)
    assert values, f"[{section}] {key}= missing"
    return values[-1]


@pytest.mark.parametrize("path, cli, binary", [(TRAIN, train_cli, "odl-train"),
                                               (SERVE, serve_cli, "odl-serve")])
def test_unit_has_the_required_settings(path, cli, binary):
    unit = parse_unit(path)
    assert set(unit) == {"Unit", "Service", "Install"}
    assert "%i" in _one(unit, "Unit", "Description")
    assert "network-online.target" in _one(unit, "Unit", "After")
    s = "Service"
    assert _one(unit, s, "Restart") == "on-failure"
    assert _one(unit, s, "KillSignal") == "SIGTERM"
    no_restart = _one(unit, s, "RestartPreventExitStatus").split()
    assert "2" in no_restart  # a bad config: retrying cannot help
    if binary == "odl-train":
        assert "3" in no_restart  # fenced by a newer trainer of the same delta topic
    stop = int(_one(unit, s, "TimeoutStopSec"))
    assert stop >= (300 if binary == "odl-train" else 30)
    for key, want in [("NoNewPrivileges", "yes"), ("ProtectSystem", "strict"),
                      ("PrivateTmp", "yes"), ("ProtectHome", "yes"),
                      ("ProtectKernelTunables", "yes"), ("ProtectControlGroups", "yes"),
                      ("RestrictSUIDSGID", "yes"), ("CapabilityBoundingSet", "")]:
        assert _one(unit, s, key) == want, key
    families = set(_one(unit, s, "RestrictAddressFamilies").split())
    assert {"AF_INET", "AF_INET6", "AF_UNIX"} <= families
    assert "/var/lib/odl" in _one(unit, s, "ReadWritePaths").split()
    assert _one(unit, s, "User") != "root"
    assert "PrivateDevices" not in unit[s], "PrivateDevices hides the GPU from CUDA"
    assert "MemoryDenyWriteExecute" not in unit[s], "breaks PyTorch's JIT"
    assert _one(unit, "Install", "WantedBy") == "multi-user.target"
    # ExecStart: the right program, the instance's config / exports, flags the CLI knows.
    argv = shlex.split(_one(unit, s, "ExecStart"))
    assert argv[0].startswith("/") and argv[0].endswith("/" + binary)
    known = {a for action in cli.build_parser()._actions for a in action.option_strings}
    flags = [a for a in argv[1:] if a.startswith("--")]
    assert flags and all(f in known for f in flags), (flags, known)
    if binary == "odl-train":
        assert "--online" in argv
        assert argv[argv.index("--pipeline_config_path") + 1] == "/etc/odl/%i.config"
    else:
        assert argv[argv.index("--export_dir") + 1] == "${ODL_EXPORT_DIR}"
        assert any("%i" in v for v in unit[s]["Environment"] if v.startswith("ODL_EXPORT_DIR="))
    assert "/etc/odl/%i.env" in [v.lstrip("-") for v in unit[s]["EnvironmentFile"]]


@pytest.mark.parametrize("drop_in", [RANKS, HOSTS], ids=["one-host", "several-hosts"])
def test_ranks_drop_in_runs_the_trainer_under_torchrun(drop_in):
    """The drop-ins replace odl-train@'s ExecStart with torchrun running the same CLI with
    flags it knows, and stop every rank (not only torchrun) on systemctl stop; the hosts'
    one meets at a rendezvous named after the instance."""
    unit = parse_unit(drop_in)
    assert set(unit) == {"Service"}
    s = unit["Service"]
    assert s["ExecStart"][0] == ""  # clears the unit's own ExecStart first
    argv = shlex.split(s["ExecStart"][-1])
    assert argv[0].startswith("/") and argv[0].endswith("/torchrun")
    assert "--max-restarts" in argv
    if drop_in == RANKS:
        assert "--standalone" in argv
    else:
        assert argv[argv.index("--nnodes") + 1] == "${ODL_HOSTS}"
        assert argv[argv.index("--rdzv_backend") + 1] == "c10d"
        assert argv[argv.index("--rdzv_endpoint") + 1] == "${ODL_RDZV_ENDPOINT}"
        assert "%i" in argv[argv.index("--rdzv_id") + 1]
    assert argv[argv.index("--nproc_per_node") + 1] == "${ODL_RANKS}"
    assert argv[argv.index("-m") + 1] == "odl.cli.train_cli"
    cli_args = argv[argv.index("-m") + 2:]
    known = {a for action in train_cli.build_parser()._actions for a in action.option_strings}
    flags = [a for a in cli_args if a.startswith("--")]
    assert flags and all(f in known for f in flags), (flags, known)
    assert "--online" in cli_args
    assert cli_args[cli_args.index("--pipeline_config_path") + 1] == "/etc/odl/%i.config"
    assert s["KillMode"][-1] == "control-group"


def test_env_example_documents_every_variable_the_units_use():
    used = set()
    for path in (TRAIN, SERVE, RANKS, HOSTS):
        used |= set(re.findall(r"\$\{?(ODL_\w+)", path.read_text()))
    text = ENV_EXAMPLE.read_text()
    documented = set(re.findall(r"^#?(ODL_\w+)=", text, flags=re.M))
    assert used and used <= documented, used - documented
    assert "ODL_AUTH_TOKEN" in documented


def test_operations_doc_covers_the_lifecycle():
    doc = (Path(REPO) / "docs" / "operations.md").read_text()
    for topic in ("odl-train@", "odl-serve@", "OSS_STOP_SIGNAL", "systemctl stop",
                  "journalctl", "/status", "/healthz", "/metrics", "ODL_AUTH_TOKEN",
                  "Upgrade", "Recover", "odl-export"):
        assert topic in doc, topic


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed (the pure-Python checks above "
                           "still run)")
@pytest.mark.parametrize("drop_in", [RANKS, HOSTS], ids=["one-host", "several-hosts"])
def test_systemd_analyze_verify(tmp_path, drop_in):
    """systemd's own parser: no unknown keys, bad values or missing sections.

    The ExecStart binaries are pointed at this checkout's venv (verify requires them to
    exist) and the templates are checked as instance ``ctr``, the train unit with a
    torchrun drop-in.
    """
    bin_dir = Path(REPO) / ".venv" / "bin"
    if not (bin_dir / "odl-train").exists():
        pytest.skip("odl is not installed in .venv (make venv)")
    names = []
    for path in (TRAIN, SERVE):
        text = path.read_text().replace("/opt/odl/venv/bin/", f"{bin_dir}/")
        name = path.name.replace("@.", "@ctr.")
        (tmp_path / name).write_text(text)
        names.append(f"./{name}")
    # the torchrun drop-in, read with the train unit from this directory
    drop_dir = tmp_path / (TRAIN.name.replace("@.", "@ctr.") + ".d")
    drop_dir.mkdir()
    (drop_dir / drop_in.name).write_text(
        drop_in.read_text().replace("/opt/odl/venv/bin/", f"{bin_dir}/"))
    res = subprocess.run(["systemd-analyze", "verify", *names], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "SYSTEMD_UNIT_PATH": f"{tmp_path}:"})
    problems = [ln for ln in (res.stdout + res.stderr).splitlines() if ln.strip()
                and "Failed to connect to bus" not in ln]
    assert res.returncode == 0 and problems == [], res.stdout + res.stderr
