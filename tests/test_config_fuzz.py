"""Config fuzz: random mutations of the sample config never crash ``odl-train``.

Each seeded mutation of ``samples/deepfm_online.config`` (lines deleted, duplicated or
swapped, values of the wrong type, unknown field names, truncation, random bytes) goes
through ``odl-train --validate_only`` in-process: the result must be exit 0 ("config OK") or
exit 2 with one line on stderr naming the problem (or, for several field errors found in one
pass, a "N config errors:" line and one indented line per error), never a traceback or
another exception.
A few mutations also run as real subprocesses to prove the command-line path agrees.
"""

from __future__ import annotations

import contextlib
import io
import logging
import random
import re
import subprocess
import sys

import pytest

from odl.cli import train_cli
from tests.harness import REPO

SAMPLE = f"{REPO}/samples/deepfm_online.config"
N_CASES = 400
SEED = 77

_WRONG_VALUES = ['"text"', "-1", "0", "1e999", "-1e999", "true", "{}", "[1, 2]", "nan", "inf",
                 "18446744073709551616", "-9223372036854775809", '""', "''", "0x10", "1.5",
                 '"\\xff"', "NONE", "[]", "{ x: 1 }", '"a" "b"']
_KEY_VALUE = re.compile(r"\b(\w+)(\s*:\s*)([^\s{}\[\]]+|\[[^\]]*\])")


def _mutate(text: str, rng: random.Random) -> bytes:
    """One to three random edits of the config text."""
    data: str | bytes = text
    for _ in range(rng.randint(1, 3)):
        if isinstance(data, bytes):
            break
        lines = data.split("\n")
        op = rng.randrange(9)
        i = rng.randrange(len(lines))
        if op == 0:
            del lines[i]
        elif op == 1:
            lines.insert(i, lines[rng.randrange(len(lines))])
        elif op == 2:
            j = rng.randrange(len(lines))
            lines[i], lines[j] = lines[j], lines[i]
        elif op in (3, 4):  # a value of the wrong type
            spots = [(k, m) for k, ln in enumerate(lines) for m in _KEY_VALUE.finditer(ln)
                     if not ln.lstrip().startswith("#")]
            if not spots:
                continue
            k, m = rng.choice(spots)
            ln = lines[k]
            lines[k] = ln[:m.start(3)] + rng.choice(_WRONG_VALUES) + ln[m.end(3):]
        elif op == 5:  # an unknown (or misspelt) field name
            spots = [(k, m) for k, ln in enumerate(lines) for m in _KEY_VALUE.finditer(ln)
                     if not ln.lstrip().startswith("#")]
            if not spots:
                continue
            k, m = rng.choice(spots)
            ln = lines[k]
            name = rng.choice([m.group(1)[:-1] or "x", m.group(1) + "s",
                               "".join(rng.choice("abcdefgh_") for _ in range(8))])
            lines[k] = ln[:m.start(1)] + name + ln[m.end(1):]
        elif op == 6:  # truncate
            joined = "\n".join(lines)
            data = joined[: rng.randrange(len(joined))]
            continue
        elif op == 7:  # random bytes somewhere (possibly invalid UTF-8 or NUL)
            raw = "\n".join(lines).encode()
            at = rng.randrange(len(raw))
            data = raw[:at] + rng.randbytes(rng.randint(1, 12)) + raw[at:]
            continue
        else:  # drop or add a brace / colon / quote
            ln = lines[i]
            if ln:
                c = rng.randrange(len(ln))
                lines[i] = ln[:c] + rng.choice(["", "{", "}", ":", '"', "[", "]"]) + ln[c + 1:]
        data = "\n".join(lines)
    return data if isinstance(data, bytes) else data.encode()


def _cases() -> list[bytes]:
    rng = random.Random(SEED)
    text = open(SAMPLE, encoding="utf-8").read()
    return [_mutate(text, rng) for _ in range(N_CASES)]


def _check(rc: int, out: str, err: str, case: bytes) -> None:
    assert "Traceback" not in err, (case[:2000], err)
    assert rc in (0, 2), (rc, err, case[:2000])
    if rc == 0:
        assert out.strip() == "config OK"
    else:
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert lines[0].startswith("odl-train: "), (err, case[:2000])
        many = re.match(r"odl-train: (\d+) config errors:$", lines[0])
        if many:
            assert len(lines) == 1 + int(many.group(1)) > 2, (err, case[:2000])
            assert all(ln.startswith("  invalid config field '") for ln in lines[1:]), err
        else:
            assert len(lines) == 1, (err, case[:2000])


def test_mutated_configs_are_accepted_or_refused_with_one_line(tmp_path):
    path = tmp_path / "mutated.config"
    outcomes = {0: 0, 2: 0}
    fields: set[str] = set()
    logging.getLogger().setLevel(logging.CRITICAL)
    for case in _cases():
        path.write_bytes(case)
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = train_cli.main(["--pipeline_config_path", str(path), "--online",
                                     "--validate_only", "--log_level", "CRITICAL"])
            except SystemExit as exc:  # argparse only; never expected here
                rc = int(exc.code or 0)
            except Exception as exc:  # noqa: BLE001 - the test's point: report any crash
                pytest.fail(f"{type(exc).__name__}: {exc} on config:\n"
                            f"{case[:3000].decode(errors='replace')}")
        _check(rc, out.getvalue(), err.getvalue(), case)
        outcomes[rc] += 1
        m = re.search(r"invalid config field '([^']+)'", err.getvalue())
        if m:
            fields.add(m.group(1).split(".")[0].split("[")[0])
    # The fuzz reaches both outcomes and errors all over the config.
    assert outcomes[2] > N_CASES // 3 and outcomes[0] > 10, outcomes
    assert len(fields) >= 5, fields


def test_command_line_agrees(tmp_path):
    """Five mutations through a real ``odl-train`` process: same exit code and message."""
    text = open(SAMPLE, encoding="utf-8").read()
    cases = [
        text.replace("batch_size: 1024", "batch_size: many").encode(),
        text.replace("embedding_dim: 16 hash_bucket_size: 10000",
                     "embedding_dim: 16 hash_bucket_sizes: 10000", 1).encode(),
        text[: len(text) // 2].encode(),
        text.encode()[:500] + b"\xff\xfe" + text.encode()[500:],
        (text + "\n# a comment\n").encode(),
    ]
    procs = []
    for i, case in enumerate(cases):
        p = tmp_path / f"c{i}.config"
        p.write_bytes(case)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "odl.cli.train_cli", "--pipeline_config_path", str(p),
             "--online", "--validate_only"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO))
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        err_lines = [ln for ln in err.splitlines() if ln.startswith("odl-train")]
        assert "Traceback" not in err, err
        results.append((proc.returncode, err_lines, out))
        if proc.returncode == 2:
            assert len(err_lines) == 1, err
    assert [r[0] for r in results] == [2, 2, 2, 2, 0], results
    assert "data_config.batch_size" in results[0][1][0]
    assert "hash_bucket_sizes" in results[1][1][0]
    assert "pipeline_config_path" in results[3][1][0]
    assert results[4][2].strip() == "config OK"
