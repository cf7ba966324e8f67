"""``make demo-filestream``: PaddleRec-style file-stream training end to end, in about 30 s.

Two days of synthetic samples land as ``data/YYYYMMDD/HHMM/part-*`` splits with a
``to.hadoop.done`` donefile each; ``odl-train --online`` trains on them pass by pass, writes
PaddleRec's day/pass saves, and stops by itself after ``end_day``; two ``odl-serve``
processes then serve the result from those saves, and their predictions are compared.

1. ``odl-datagen --split-dir`` writes the upstream's two days (the two days before today,
   UTC: event times more than a day ahead of the clock are rejected) into ``upstream/``:
   four 6-hour splits a day (0000, 0600, 1200, 1800). One stream for both days, so the
   second day continues the first one's hidden model and ids.
   The first day is moved into ``data/`` at once.
2. ``odl-train --online`` on ``samples/deepfm_filestream.config`` (``--edit_config_json``:
   paths under the demo directory, ``start_day`` / ``end_day`` = the two days): two splits
   per pass, a checkpoint per pass, saves under ``saves/``. Each pass is printed from the
   trainer's ``/status`` (``passes``) as it closes: samples, progressive AUC and logloss,
   train AUC.
3. Once the trainer has read the first day and waits for the next split, the second day's
   splits land one by one: the part files first, the donefile a moment later (the trainer
   waits for it, looking every ``data_sleep_second``).
4. After the second day the trainer ends by itself (``end of input``, exit 0). The demo prints
   the save layout (``saves/<day>/<pass_id>`` checkpoints, ``delta_<pass_id>``, ``base/``;
   the first base is the starting model, as the day before the first day) and checks it.
5. Serving A: ``odl-serve --export_dir saves/<day before>/base --delta_dir saves`` (the
   starting model plus every pass delta, in (day, pass) order); serving B: ``odl-serve
   --export_dir saves/<last day>/base --no_replay``. Both get the same 1,000 records (125 from
   each split) on ``/predict``; the largest difference must be at most 1e-5.
6. Both servers stopped with SIGTERM; a list of the checks that held. Exit 0 when all held.

Everything listens on 127.0.0.1. Data, saves and logs stay in ``.odl/demo-filestream``
(removed at the start of each run).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from typing import Any, Optional

from odl.demos.kafka_demo import _free_port, _get, _py, _say, _stop_all
from odl.train.torch_runtime import quiet_library_noise

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "samples", "deepfm_filestream.config")
WORK = os.path.join(ROOT, ".odl", "demo-filestream")
DONEFILE = "to.hadoop.done"  # the sample config's data_donefile
SPLIT_INTERVAL = 360  # minutes; the sample config's split_interval
SPLITS_PER_DAY = 1440 // SPLIT_INTERVAL
BATCH_SIZE = 512  # the sample config's data_config.batch_size
PARITY_TOLERANCE = 1e-5
_PASS_LINE = re.compile(r"pass (\d{8})/(\d+): (\d+) samples, progressive auc (\S+) logloss (\S+),")
_TRAIN_AUC_LINE = re.compile(r"pass (\d{8})/(\d+): train auc (\S+) logloss (\S+) \((\d+) samples")


class DemoError(RuntimeError):
    """A step of the demo did not do what it should."""


def _day(offset: int) -> str:
    """``YYYYMMDD`` (UTC) ``offset`` days from today."""
    return (dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=offset)).strftime("%Y%m%d")


def _trainer_status(model_dir: str, pid: int) -> Optional[dict]:
    """The trainer's ``/status`` (its address from ``model_dir/status.json``), None if down."""
    try:
        with open(os.path.join(model_dir, "status.json")) as f:
            url = json.load(f)["url"]
    except (OSError, ValueError, KeyError):
        return None
    st = _get(url + "/status")
    return st if st is not None and st.get("pid") == pid else None


def _fmt(value: Any, digits: int = 4) -> str:
    return "-" if value is None else f"{float(value):.{digits}f}"


class PassPrinter:
    """Prints each closed pass once, from the trainer's ``/status`` or, at the end, its log.

    Args:
        log_path: the trainer's log (for passes closed after the last ``/status`` answer).
    """

    def __init__(self, log_path: str) -> None:
        self.log_path = log_path
        self.passes: dict[tuple[str, int], dict] = {}

    def update(self, st: Optional[dict]) -> None:
        """Prints the passes ``/status`` shows closed (once their train AUC is in)."""
        for p in ((st or {}).get("passes") or {}).get("passes", []):
            key = (p["day"], int(p["pass"]))
            if key not in self.passes and p.get("train_auc") is not None:
                self._print(key, p, "")

    def finish(self) -> None:
        """Prints the passes closed after the trainer's last ``/status`` answer (its log)."""
        found: dict[tuple[str, int], dict] = {}
        with open(self.log_path, errors="replace") as f:
            for line in f:
                m = _PASS_LINE.search(line)
                if m:
                    found[(m[1], int(m[2]))] = {
                        "samples": int(m[3]), "auc": _num(m[4]), "logloss": _num(m[5]),
                        "train_auc": None}
                m = _TRAIN_AUC_LINE.search(line)
                if m and (m[1], int(m[2])) in found:
                    found[(m[1], int(m[2]))]["train_auc"] = _num(m[3])
        for key in sorted(found):
            if key not in self.passes:
                self._print(key, found[key], " (from the trainer's log: it has exited)")

    def _print(self, key: tuple[str, int], p: dict, note: str) -> None:
        self.passes[key] = p
        _say(f"pass {key[0]}/{key[1]} closed: {p['samples']:,} samples, progressive auc "
             f"{_fmt(p['auc'])} logloss {_fmt(p['logloss'])}, train auc "
             f"{_fmt(p.get('train_auc'))}{note}")

    def table(self) -> None:
        """Prints every pass as a table."""
        _say(f"{'day':<9} {'pass':>4} {'samples':>8} {'prog. auc':>9} {'logloss':>8} "
             f"{'train auc':>9}")
        for (day, pass_id), p in sorted(self.passes.items()):
            _say(f"{day:<9} {pass_id:>4} {p['samples']:>8,} {_fmt(p['auc']):>9} "
                 f"{_fmt(p['logloss']):>8} {_fmt(p.get('train_auc')):>9}")


def _num(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None


def _write_upstream(upstream: str, first_day: str, per_split: int) -> dict:
    """Both days' splits with ``odl-datagen --split-dir``; returns its summary line."""
    out = subprocess.run(
        _py("odl.cli.datagen_cli", "--split-dir", upstream, "--day", first_day,
            "--start", "0000", "--splits", str(2 * SPLITS_PER_DAY),
            "--split-interval", str(SPLIT_INTERVAL), "--count", str(per_split),
            "--parts", "2", "--donefile", DONEFILE, "--seed", "7", "-q"),
        capture_output=True, text=True, cwd=ROOT, timeout=300)
    if out.returncode != 0:
        raise DemoError(f"odl-datagen exited with {out.returncode}: {out.stderr.strip()}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _splits(upstream: str, day: str) -> list[str]:
    return sorted(os.listdir(os.path.join(upstream, day)))


def _start_trainer(work: str, first_day: str, last_day: str, log) -> subprocess.Popen:
    edits = json.dumps({
        "model_dir": os.path.join(work, "model_dir"),
        "file_stream_input.train_data_dir": os.path.join(work, "data"),
        "file_stream_input.model_save_path": os.path.join(work, "saves"),
        "file_stream_input.start_day": first_day,
        "file_stream_input.end_day": last_day,
    })
    cmd = _py("odl.cli.train_cli", "--online", "--pipeline_config_path", CONFIG,
              "--edit_config_json", edits, "--status_port", "0", "--status_host", "127.0.0.1")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)


def _watch(model_dir: str, trainer: subprocess.Popen, printer: PassPrinter, until,
           timeout: float, what: str) -> Optional[dict]:
    """Polls the trainer's ``/status`` (printing closed passes) until ``until(status)``.

    Returns:
        The status that satisfied ``until``, or None when the trainer exited first.

    Raises:
        DemoError: the timeout passed.
    """
    deadline = time.time() + timeout
    while time.time() < deadline:
        if trainer.poll() is not None:
            return None
        st = _trainer_status(model_dir, trainer.pid)
        printer.update(st)
        if st is not None and until(st):
            return st
        time.sleep(0.25)
    raise DemoError(f"timed out after {timeout:.0f} s waiting for {what}")


def _source(st: dict) -> dict:
    return st.get("input", {}).get("source", {}) or {}


def _waiting_at(split: str):
    """A ``_watch`` condition: the trainer's input waits for ``split`` (``YYYYMMDD/HHMM``)."""
    def until(st: dict) -> bool:
        src = _source(st)
        return src.get("split") == split and bool(src.get("waiting"))
    return until


def _land_day(upstream: str, data: str, day: str) -> None:
    """Moves a whole day (complete splits) from the upstream into ``data/``."""
    os.rename(os.path.join(upstream, day), os.path.join(data, day))


def _land_split(upstream: str, data: str, day: str, hhmm: str, with_donefile: bool) -> None:
    """Moves a split's part files (or its donefile) from the upstream into ``data/``."""
    src, dst = os.path.join(upstream, day, hhmm), os.path.join(data, day, hhmm)
    os.makedirs(dst, exist_ok=True)
    for name in sorted(os.listdir(src)):
        if (name == DONEFILE) == with_donefile:
            os.rename(os.path.join(src, name), os.path.join(dst, name))


def _dir_size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _describe(path: str, name: str, first_day: bool) -> str:
    """One line on a ``<day>`` entry of ``model_save_path`` (``first_day``: the oldest day)."""
    if name.isdigit():
        with open(os.path.join(path, "MANIFEST.json")) as f:
            step = json.load(f)["global_step"]
        return f"pass {name}'s checkpoint, step {step}"
    if name.startswith("delta_"):
        versions = [int(f.split("-")[0]) for f in os.listdir(path) if f.endswith(".delta")]
        return (f"pass {name[6:]}'s delta, version {max(versions)}, "
                f"{_dir_size(path) / 1e6:.1f} MB")
    if name == "base":
        exports = sorted(e for e in os.listdir(path) if e.isdigit())
        with open(os.path.join(path, exports[-1], "serving_model.json")) as f:
            step = json.load(f)["global_step"]
        what = "the starting model" if first_day else "the model at the day's end"
        return f"{what}: export base/{exports[-1]}, step {step}"
    return ""


def _entry_order(name: str) -> tuple[int, int, str]:
    if name.isdigit():
        return 0, int(name), name
    if name.startswith("delta_") and name[6:].isdigit():
        return 1, int(name[6:]), name
    return 2, 0, name


def _show_saves(saves: str) -> dict[str, list[str]]:
    """Prints ``model_save_path`` two levels deep; returns ``{day: [entries]}``."""
    layout: dict[str, list[str]] = {}
    _say(f"{os.path.relpath(saves, ROOT)}/  (file_stream_input.model_save_path)")
    days = sorted(d for d in os.listdir(saves) if not d.startswith("."))
    for day in days:
        entries = sorted((e for e in os.listdir(os.path.join(saves, day))
                          if not e.startswith(".")), key=_entry_order)
        layout[day] = entries
        _say(f"  {day}/")
        for e in entries:
            _say(f"    {e + '/':<10} {_describe(os.path.join(saves, day, e), e, day == days[0])}")
    return layout


def _start_serving(args: list[str], log_path: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen(
        _py("odl.cli.serve_cli", *args, "--host", "127.0.0.1", "--port", str(port)),
        stdout=open(log_path, "w"), stderr=subprocess.STDOUT, cwd=ROOT)
    return proc, f"http://127.0.0.1:{port}"


def _wait_serving(name: str, proc: subprocess.Popen, url: str, ready, timeout: float = 120
                  ) -> dict:
    deadline = time.time() + timeout
    st: Optional[dict] = None
    while time.time() < deadline:
        if proc.poll() is not None:
            raise DemoError(f"serving {name} exited with {proc.returncode}; see its log")
        st = _get(url + "/status")
        if st is not None and ready(st):
            return st
        time.sleep(0.5)
    raise DemoError(f"serving {name} not ready after {timeout:.0f} s: {st}")


def _predict(url: str, records: list[bytes]) -> list[float]:
    req = urllib.request.Request(url + "/predict", data=b"\n".join(records), method="POST")
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)["probabilities"]


def _sample_records(data: str, per_split: int = 125) -> list[bytes]:
    """The first ``per_split`` records of every split's first part file."""
    records: list[bytes] = []
    for day in sorted(os.listdir(data)):
        for hhmm in sorted(os.listdir(os.path.join(data, day))):
            with open(os.path.join(data, day, hhmm, "part-00000"), "rb") as f:
                for _, line in zip(range(per_split), f, strict=False):
                    records.append(line.rstrip(b"\n"))
    return records


def _stop_serving(procs: list[subprocess.Popen]) -> bool:
    """SIGTERM to each server; True when every one exited 0 within 60 s."""
    ok = True
    for p in procs:
        if p.poll() is None:
            p.terminate()
        try:
            ok = p.wait(timeout=60) == 0 and ok
        except subprocess.TimeoutExpired:
            p.kill()
            ok = False
    return ok


def main(argv: Optional[list[str]] = None) -> int:
    """Runs the file-stream demo; returns 0 when every check held."""
    ap = argparse.ArgumentParser(prog="odl-demo-filestream")
    ap.add_argument("--batches_per_split", type=int, default=100,
                    help=f"records per split, in batches of {BATCH_SIZE} (default 100)")
    args = ap.parse_args(argv)
    quiet_library_noise()  # the checks build models in this process
    per_split = args.batches_per_split * BATCH_SIZE

    t_start = time.monotonic()
    shutil.rmtree(WORK, ignore_errors=True)
    upstream, data = os.path.join(WORK, "upstream"), os.path.join(WORK, "data")
    saves, model_dir = os.path.join(WORK, "saves"), os.path.join(WORK, "model_dir")
    os.makedirs(data)
    day0, day1, day2 = _day(-3), _day(-2), _day(-1)  # day0: the first base's day
    procs: list[subprocess.Popen] = []
    checks: dict[str, bool] = {}
    train_log_path = os.path.join(WORK, "trainer.log")
    printer = PassPrinter(train_log_path)
    try:
        summary = _write_upstream(upstream, day1, per_split)
        _say(f"odl-datagen --split-dir wrote {summary['records']:,} records in "
             f"{len(summary['splits'])} splits ({per_split:,} each, 2 part files + "
             f"{DONEFILE}) for {day1} and {day2}; oracle AUC {summary['oracle_auc']}")
        _land_day(upstream, data, day1)
        _say(f"day {day1} landed in {os.path.relpath(data, ROOT)}/{day1}/: splits "
             f"{', '.join(_splits(data, day1))}")

        train_log = open(train_log_path, "w")
        trainer = _start_trainer(WORK, day1, day2, train_log)
        procs.append(trainer)
        _say(f"odl-train --online on {os.path.relpath(CONFIG, ROOT)} (start_day {day1}, "
             f"end_day {day2}, 2 splits per pass; log: {os.path.relpath(train_log_path, ROOT)})")
        st = _watch(model_dir, trainer, printer, lambda s: True, 120, "the trainer's /status")
        if st is None:
            raise DemoError(f"the trainer exited with {trainer.returncode}; see its log")
        _say(f"trainer up (pid {st['pid']}); its /status is polled for the passes")

        first_of_day2 = f"{day2}/{_splits(upstream, day2)[0]}"
        st = _watch(model_dir, trainer, printer, _waiting_at(first_of_day2), 300,
                    f"the trainer to finish {day1}")
        if st is None:
            raise DemoError(f"the trainer exited with {trainer.returncode} before {day2}")
        cur = (st.get("passes") or {}).get("current_pass") or {}
        _say(f"trainer read all of {day1} ({st['samples_trained']:,} samples) and waits for "
             f"{first_of_day2} (pass {cur.get('day')}/{cur.get('pass')} stays open until the "
             f"next pass's first batch)")
        time.sleep(3)

        for hhmm in _splits(upstream, day2):
            split = f"{day2}/{hhmm}"
            _land_split(upstream, data, day2, hhmm, with_donefile=False)
            time.sleep(1.5)
            st = _trainer_status(model_dir, trainer.pid)
            printer.update(st)
            src = _source(st or {})
            _say(f"landed {split}'s part files, no {DONEFILE} yet: trainer at "
                 f"{src.get('split')}, waiting={src.get('waiting')}, samples "
                 f"{(st or {}).get('samples_trained', 0):,}")
            _land_split(upstream, data, day2, hhmm, with_donefile=True)
            _say(f"landed {split}/{DONEFILE}")
            nxt = (dt.datetime.strptime(day2 + hhmm, "%Y%m%d%H%M")
                   + dt.timedelta(minutes=SPLIT_INTERVAL)).strftime("%Y%m%d/%H%M")
            if nxt.startswith(day2):
                if _watch(model_dir, trainer, printer, _waiting_at(nxt), 300,
                          f"the trainer to read {split}") is None:
                    break

        rc = trainer.wait(timeout=300)
        train_log.close()
        printer.finish()
        with open(train_log_path, errors="replace") as f:
            ended = "stopping: end of input" in f.read()
        _say(f"trainer exited with code {rc}" + (" (end of input: past end_day)" if ended
                                                 else ""))
        checks[f"trainer read both days and ended by itself (exit 0, end of input after "
               f"{day2})"] = rc == 0 and ended
        if rc != 0:
            raise DemoError(f"the trainer failed; see {train_log_path}")
        _say("passes (progressive auc: predicted before training on them; train auc: the "
             "pass's sample scored again after it):")
        printer.table()
        want_passes = [(d, p) for d in (day1, day2) for p in (1, 2)]
        checks["four passes, two a day, each with its AUCs"] = sorted(printer.passes) == \
            want_passes and all(p["auc"] is not None and p.get("train_auc") is not None
                                for p in printer.passes.values())

        layout = _show_saves(saves)
        day_entries = ["1", "2", "delta_1", "delta_2", "base"]
        checks[f"saves: {day0}/base (starting model), {day1} and {day2} each with per-pass "
               f"checkpoints, deltas and a day base"] = layout == {
            day0: ["base"], day1: day_entries, day2: day_entries}
        deltas = sum(1 for entries in layout.values() for e in entries
                     if e.startswith("delta_"))

        serve_a, url_a = _start_serving(
            ["--export_dir", os.path.join(saves, day0, "base"), "--delta_dir", saves],
            os.path.join(WORK, "serving-a.log"))
        serve_b, url_b = _start_serving(
            ["--export_dir", os.path.join(saves, day2, "base"), "--no_replay"],
            os.path.join(WORK, "serving-b.log"))
        procs += [serve_a, serve_b]
        _say(f"serving A: odl-serve --export_dir saves/{day0}/base --delta_dir saves ({url_a})")
        _say(f"serving B: odl-serve --export_dir saves/{day2}/base --no_replay ({url_b})")
        st_a = _wait_serving("A", serve_a, url_a, lambda s: (s.get("pass_deltas") or {}).get(
            "deltas_applied") == deltas)
        st_b = _wait_serving("B", serve_b, url_b, lambda s: True)
        pd = st_a["pass_deltas"]
        _say(f"serving A: base version {st_a['base_version']} + {pd['deltas_applied']} deltas "
             f"(last {pd['last_applied']}) = version {st_a['version']}")
        _say(f"serving B: base version {st_b['base_version']}, no replay = version "
             f"{st_b['version']}")
        checks["A applied every delta and reached B's version"] = (
            pd["deltas_applied"] == deltas and st_a["version"] == st_b["version"])

        records = _sample_records(data)
        pa, pb = _predict(url_a, records), _predict(url_b, records)
        diff = max(abs(a - b) for a, b in zip(pa, pb, strict=True))
        _say(f"/predict on {len(records):,} records (125 from each split): max |A - B| = "
             f"{diff:.2e}")
        checks[f"starting base + all deltas == last day's base (max |diff| <= "
               f"{PARITY_TOLERANCE:g})"] = diff <= PARITY_TOLERANCE

        checks["both servers stopped cleanly on SIGTERM"] = _stop_serving([serve_a, serve_b])
        return 0 if all(checks.values()) else 1
    except Exception as exc:  # the demo reports, then cleans up
        _say(f"FAILED: {type(exc).__name__}: {exc}")
        checks.setdefault("the demo ran to the end", False)
        return 1
    finally:
        _stop_all(procs)
        for name, ok in checks.items():
            _say(f"{'ok  ' if ok else 'FAIL'} {name}")
        ok = bool(checks) and all(checks.values())
        _say(f"everything stopped after {time.monotonic() - t_start:.0f} s; data, saves and "
             f"logs in {os.path.relpath(WORK, ROOT)}/. File-stream demo "
             f"{'succeeded' if ok else 'FAILED'}.")


if __name__ == "__main__":
    sys.exit(main())
