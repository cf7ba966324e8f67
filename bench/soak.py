"""Soak: the main job run as a user runs it, for N minutes, with per-minute figures.

Everything real and local, the sample config as fetched (only its servers and model_dir are
pointed at this run's broker and work directory):

* ``odl-kafka up --port 0 --data-dir <work>/kafka`` with its default retention (32 MiB per
  partition, 24 h: at 10k samples/s the sample topic's first records are deleted after about
  a minute), and ``odl-kafka create-topic <delta topic> --retention_mb 128``
  (``--delta-retention-mb``): the delta topic must keep every version since the newest
  checkpoint and export, about 27 s of the sample's 4.7 MB/s of versions at 10k samples/s,
  which odl-kafka's default would keep for 7 s only (docs/training.md#broker-retention);
* ``odl-datagen --rate R --partitions P`` into the config's topic, for the whole soak;
* ``odl-train --online --pipeline_config_path samples/deepfm_online.config
  --edit_config_json '{"kafka_train_input.server": ..., "train_config.incr_save_config.
  kafka.server": ..., "model_dir": ...}'`` (nothing else edited);
* once the first periodic checkpoint (step > 0; the sample saves every 200 steps) is there,
  ``odl-export`` of it and ``odl-serve`` on the export, replaying the delta topic from the
  export's ``kafka.txt`` offset.

Every ``--interval`` seconds (5) the bench reads the trainer's ``/status`` (URL from
``model_dir/status.json``), serving's ``/status`` and ``/metrics``, the sample topic's
watermarks, and with psutil RSS and CPU time of each process: trainer, its input child
process (``odl.inputs.kafka_input_child``), serving, broker (``noida-db``, pid from
``broker.json``), datagen, and the bench itself (its pollers cost something too). At each
minute (from the first produced record) it prints one row:

* train/s: samples trained per second (``samples_trained``); prod/s: records produced per
  second (the broker's end offsets);
* lag: records produced but not trained, summed over partitions (the broker's end offsets read
  right after the trainer's trained positions, so slightly over), at the minute's end and the
  largest sampled within it;
* freshness p50 / p99 (see below) of the versions serving applied in the minute;
* ver/s, MB/s: versions and delta bytes published (the trainer's ``publisher`` status);
* lost: records deleted by retention before they were trained, the largest of three counts:
  the trainer's ``/status`` ``input.retention.records_lost``, the ranges its input logs
  ("records A..B were deleted by retention"), and sum(trained positions) - samples trained -
  rejected records (a gap the trainer skipped; both read from one ``/status``, racing only
  towards a smaller figure); the JSON also keeps ``input.retention``'s state and seconds to
  loss at every sample;
* vlag: the trainer's last published version minus serving's applied version (steps);
* RSS (MiB, mean of once-a-second readings; the broker's RSS saw-tooths with its periodic
  saves, the minute's max is in the JSON) and CPU (cores, from CPU time deltas) per process.

The JSON also has, per minute, the checkpoints written (the sample saves 216 MB every 200
steps, every 20 s at 10k/s; the trainer copies the state at the step and writes it in the
background), serving's own
``freshness_seconds`` gauge (now - newest event time applied: the newest sample, not the
oldest), the trainer's own lag figure, and the smallest retention headroom (trained position
- log start, records); per poll the timeline; per applied version its bounds.

Freshness (bench/soak_freshness.py): the bench follows the delta topic itself, keeping of each
complete version only its header (min / max Kafka produce time of the samples it includes,
publish time, input positions), and polls serving's ``/status`` every ``--apply-poll`` s
(0.1) for the version it applied and ``last_apply_time``. Serving applies in topic order, so a
version was applied no later than the first version at or after it that a poll saw (exact
when the poll saw the version itself). A version's samples (the records between the previous
version's positions and its own) then waited at most apply - min produce time and at least
apply - max produce time; the sample-weighted p99 of these upper bounds over the versions
applied in a minute is an upper bound of the per-sample p99 (every sample is at most its
version's bound), printed as the minute's p99 and judged against the target; the p99 of the
lower bounds is in the JSON. The two differ by the produce-time span of a version: about one
batch (0.1-0.2 s) while the trainer keeps up (it then publishes whenever its input is idle,
every step), up to ``sparse_save_steps`` batches and the stall before them when it catches up
after a checkpoint, which is where the p99 lies: the upper bound can then read 0.5 s above
the exact figure (1.47 s against 1.00 s at 5k samples/s on the development machine). With
``--exact-freshness`` the bench
also reads the sample topic's produce timestamps (run-length encoded, dropped once covered)
and reports each sample's own apply - produce time (the definition of bench/freshness.py),
at the cost of a second consumer of the stream (its CPU shows in the bench's column: about
0.06 cores more at 5k samples/s on the development machine, and the broker serves the stream
twice); it is off by default because the machine is the bottleneck at 10k/s. Memory
is bounded either way: a few numbers per version (at most one per step: 18,000 in 30 minutes
at 10k/s), and
per minute one counter per distinct latency in ms. A minute in which serving applied no
version has no figure and fails the target. Rows are printed at each minute's end; the JSON
and the summary recount the minutes after the run, with versions resolved a little later.

Summary (steady state = after ``--warmup-minutes``): largest lag, worst minute's p99, records
lost, RSS growth per process from the first to the last steady minute, the trainer's CPU
(trainer + input process) per 10k samples/s, and PASS / FAIL against the targets: lag < 20k
after the warm-up, p99 <= 1 s every minute, nothing lost, RSS flat within +-10 %; serving's
delta replay resets (versions it never saw, deleted by retention first) are reported as a
check too. Everything shares this machine's cores: when the asked rate is not reached the
summary says so. Everything is stopped at the end, on Ctrl-C / SIGTERM and on a failure:
datagen (SIGTERM), trainer (``OSS_STOP_SIGNAL`` when the config enables it, else SIGTERM),
serving (SIGTERM), broker (``odl-kafka down``); the bench then checks that none of their
processes is left.

    .venv/bin/python bench/soak.py [--minutes 30] [--rate 10000] [--partitions 4]
        [--config samples/deepfm_online.config] [--warmup-minutes 5] [--interval 5]
        [--apply-poll 0.1] [--exact-freshness] [--json out.json] [--plot out.png] [--keep-dir]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import psutil  # noqa: E402
from confluent_kafka import Consumer, KafkaException, TopicPartition  # noqa: E402

from bench.soak_freshness import (  # noqa: E402
    DeltaHeaders,
    FreshnessTracker,
    SampleTimestamps,
    ServingApplies,
    TopicFollower,
)
from odl.broker.embedded_broker import free_port  # noqa: E402
from odl.cli.cli_logging import setup_logging
from odl.cli.kafka_cli import read_state  # noqa: E402
from odl.config.pipeline_config import load_pipeline_config  # noqa: E402
from odl.export.export_layout import KAFKA_FILE  # noqa: E402
from odl.harness.http_client import get_json, http_request  # noqa: E402
from odl.harness.trainer_process import trainer_json  # noqa: E402
from odl.kafka.client_settings import consumer_config  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1 << 20
ROLES = ("trainer", "input", "serving", "broker", "datagen", "bench")
CHECKED_ROLES = ROLES[:-1]  # the bench's own memory is reported, not judged
LAG_TARGET = 20_000
P99_TARGET_S = 1.0
RSS_TOLERANCE = 0.10
_CKPT_RE = re.compile(r"^model\.ckpt-(\d+)$")
_CKPT_DONE = "DONE"  # odl.checkpoint.checkpoint_manager.DONE_FILE (that module imports torch)
_LOST_RE = re.compile(rb"records (\d+)\.\.(\d+) were deleted by retention")

logger = logging.getLogger("bench.soak")


class Interrupted(Exception):
    """SIGTERM / SIGHUP to the bench: stop like Ctrl-C."""


def cli(name: str, module: str) -> list[str]:
    """The console script ``name`` beside this interpreter, else ``python -m module``."""
    path = os.path.join(os.path.dirname(sys.executable), name)
    return [path] if os.access(path, os.X_OK) else [sys.executable, "-m", module]


def kafka_cli(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """Runs ``odl-kafka`` and returns its result (raises on a non-zero exit)."""
    res = subprocess.run(cli("odl-kafka", "odl.cli.kafka_cli") + list(args), cwd=REPO,
                         capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"odl-kafka {' '.join(args)} exited {res.returncode}: "
                           f"{res.stderr.strip()}")
    return res


def log_tail(path: str, lines: int = 15) -> str:
    """The last lines of a log file ('' when missing)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 16384))
            return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")
    except OSError:
        return ""


def alive(pid: Optional[int]) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    if not pid:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def metrics_values(text: str) -> dict[str, float]:
    """``name{labels}`` -> value of a Prometheus text page."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            continue
    return out


class LogScan:
    """Counts, in a growing log, the records the trainer's input reports deleted by retention
    and the ERROR lines."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._pos = 0
        self._rest = b""
        self.lost = 0
        self.errors = 0

    def scan(self) -> None:
        """Reads what was appended since the last call."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._pos)
                data = f.read()
        except OSError:
            return
        self._pos += len(data)
        data = self._rest + data
        lines = data.split(b"\n")
        self._rest = lines.pop()
        for line in lines:
            if b" ERROR " in line:
                self.errors += 1
            m = _LOST_RE.search(line)
            if m:
                self.lost += int(m.group(2)) - int(m.group(1)) + 1


class ProcWatch:
    """RSS and cumulative CPU seconds per role (a role's process may be replaced)."""

    def __init__(self) -> None:
        self.cpu = dict.fromkeys(ROLES, 0.0)
        self._last: dict[str, tuple[int, float]] = {}
        self._procs: dict[int, psutil.Process] = {}

    def sample(self, pids: dict[str, Optional[int]]) -> dict[str, Optional[float]]:
        """Reads every role's process; returns role -> RSS MiB (None: not running)."""
        rss: dict[str, Optional[float]] = {}
        for role in ROLES:
            pid = pids.get(role)
            rss[role] = None
            if not pid:
                continue
            try:
                proc = self._procs.get(pid)
                if proc is None:
                    proc = self._procs[pid] = psutil.Process(pid)
                with proc.oneshot():
                    t = proc.cpu_times()
                    mem = proc.memory_info().rss
            except psutil.Error:
                self._procs.pop(pid, None)
                continue
            cpu = t.user + t.system
            last = self._last.get(role)
            self.cpu[role] += cpu - last[1] if last and last[0] == pid else cpu
            self._last[role] = (pid, cpu)
            rss[role] = mem / MIB
        return rss


def fmt(x: Any, digits: int = 0, width: int = 7) -> str:
    """A right-aligned number ('-' for None)."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-".rjust(width)
    if digits == 0:
        return f"{x:,.0f}".rjust(width)
    return f"{x:.{digits}f}".rjust(width)


class Soak:
    """One soak run (see the module docstring)."""

    def __init__(self, args: argparse.Namespace, work: str) -> None:
        self.args = args
        self.work = work
        self.model_dir = os.path.join(work, "model_dir")
        self.kafka_dir = os.path.join(work, "kafka")
        self.export_dir = os.path.join(work, "export")
        self.config_path = os.path.abspath(args.config)
        base = load_pipeline_config(self.config_path)
        self.topic = base.kafka_train_input.topic
        incr = base.train_config.incr_save_config
        self.delta_topic = incr.kafka.topic if incr.HasField("kafka") else ""
        self.stop_signal = bool(base.train_config.enable_oss_stop_signal)
        self.stop_poll = float(base.train_config.stop_signal_poll_secs)
        self.bootstrap = ""
        self.broker_state: dict[str, Any] = {}
        self.edits: dict[str, Any] = {}
        self.commands: dict[str, list[str]] = {}
        self.procs: dict[str, subprocess.Popen] = {}
        # every process of the job, as first seen (psutil checks a pid's identity)
        self.owned: dict[str, psutil.Process] = {}
        self.t0 = 0.0
        self.serve_url = ""
        self.stage = "starting"
        self.export: dict[str, Any] = {}
        self.timeline: list[dict[str, Any]] = []
        self.boundaries: list[dict[str, Any]] = []  # the points sampled at each minute's start
        self._marks: dict[int, tuple[int, int]] = {}
        self.rows: list[dict[str, Any]] = []
        self.watch = ProcWatch()
        # minute -> role -> [sum, count, max] of RSS MiB, read every second
        self.rss_acc: dict[int, dict[str, list[float]]] = {}
        self._last_watch = 0.0
        self.trainer_log = LogScan(os.path.join(work, "trainer.log"))
        self.serving_log = LogScan(os.path.join(work, "serving.log"))
        self.timestamps = SampleTimestamps() if args.exact_freshness else None
        self.tracker = FreshnessTracker(self.minute_of, self.timestamps)
        self.deltas = DeltaHeaders()
        self.delta_follower: Optional[TopicFollower] = None
        self.sample_follower: Optional[TopicFollower] = None
        self.applies: Optional[ServingApplies] = None
        self.marks: Optional[Consumer] = None
        self.partitions: list[int] = []
        self.start_offsets: dict[int, int] = {}
        self.last_trainer: Optional[dict[str, Any]] = None
        self.last_serving: Optional[dict[str, Any]] = None
        self.interrupted = False
        self.failure: Optional[str] = None
        self.teardown_report: dict[str, Any] = {}
        self.datagen_summary: Optional[dict[str, Any]] = None
        self.load_before = os.getloadavg()
        self.load_after: Optional[tuple[float, float, float]] = None

    # -- helpers ---------------------------------------------------------------------------

    def minute_of(self, t: float) -> int:
        """Minute index (0 = the first) of a unix time."""
        return int((t - self.t0) // 60)

    def say(self, msg: str) -> None:
        """A progress line, stamped with the seconds since the stream started."""
        stamp = f"{time.time() - self.t0:6.0f}s" if self.t0 else "     --"
        print(f"[soak {stamp}] {msg}", flush=True)

    def spawn(self, role: str, cmd: list[str], log: str, stdout: Optional[str] = None
              ) -> subprocess.Popen:
        """Starts a process in its own session (Ctrl-C reaches the bench only, which stops
        everything in order); output to ``log`` (stdout to ``stdout`` if given)."""
        self.commands[role] = cmd
        err = open(os.path.join(self.work, log), "ab")
        out = open(os.path.join(self.work, stdout), "ab") if stdout else err
        try:
            proc = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=err, start_new_session=True)
        finally:
            err.close()
            if stdout:
                out.close()
        self.procs[role] = proc
        self.own(role, proc.pid)
        return proc

    def own(self, name: str, pid: Optional[int]) -> None:
        """Remembers a process of the job (checked at the end)."""
        if pid and name not in self.owned:
            try:
                self.owned[name] = psutil.Process(pid)
            except psutil.Error:
                pass

    def pids(self) -> dict[str, Optional[int]]:
        """role -> pid of each process now (the input child found among the trainer's)."""
        out: dict[str, Optional[int]] = {r: None for r in ROLES}
        for role in ("trainer", "serving", "datagen"):
            proc = self.procs.get(role)
            if proc is not None and proc.poll() is None:
                out[role] = proc.pid
        out["broker"] = self.broker_state.get("pid")
        out["bench"] = os.getpid()
        if out["trainer"]:
            try:
                for child in psutil.Process(out["trainer"]).children():
                    if "kafka_input_child" in " ".join(child.cmdline()):
                        out["input"] = child.pid
                        self.own(f"input child {child.pid}", child.pid)
                        break
            except psutil.Error:
                pass
        return out

    def watermarks(self) -> dict[int, tuple[int, int]]:
        """partition -> (low, high) of the sample topic."""
        if self.marks is None:
            self.marks = Consumer(consumer_config(self.bootstrap,
                                                  f"odl-bench-soak-{uuid.uuid4().hex[:8]}"))
            md = self.marks.list_topics(topic=self.topic, timeout=10.0).topics[self.topic]
            if not md.partitions or md.error is not None:
                raise KeyError(self.topic)  # being created
            self.partitions = sorted(md.partitions)
        out = {}
        for p in self.partitions:
            low, high = self.marks.get_watermark_offsets(TopicPartition(self.topic, p),
                                                         timeout=5.0, cached=False)
            out[p] = (int(low), int(high))
        return out

    # -- the run ---------------------------------------------------------------------------

    def run(self) -> None:
        """Starts everything, samples until the end, prints a row per minute."""
        a = self.args
        self.say(f"work dir {self.work}")
        up = ["up", "--port", "0", "--data-dir", self.kafka_dir] + shlex.split(a.broker_args)
        self.commands["broker"] = cli("odl-kafka", "odl.cli.kafka_cli") + up
        self.bootstrap = kafka_cli(*up).stdout.strip().splitlines()[-1]
        self.broker_state = read_state(Path(self.kafka_dir)) or {}
        self.own("broker", self.broker_state.get("pid"))
        self.own("retention keeper", self.broker_state.get("retention_keeper_pid"))
        self.say(f"odl-kafka up: broker {self.bootstrap} (pid {self.broker_state.get('pid')}, "
                 f"retention {self.broker_state.get('retention')})")
        self.edits = {"kafka_train_input.server": self.bootstrap, "model_dir": self.model_dir}
        if self.delta_topic:
            self.edits["train_config.incr_save_config.kafka.server"] = self.bootstrap
            if a.delta_retention_mb > 0:  # as docs/training.md#broker-retention asks
                kafka_cli("create-topic", self.delta_topic, "--retention_mb",
                          f"{a.delta_retention_mb:g}", "--bootstrap", self.bootstrap)
                self.say(f"odl-kafka create-topic {self.delta_topic} --retention_mb "
                         f"{a.delta_retention_mb:g}")
        self.spawn("datagen", cli("odl-datagen", "odl.cli.datagen_cli") + [
            "--bootstrap", self.bootstrap, "--topic", self.topic, "--partitions",
            str(a.partitions), "--rate", str(a.rate)] + shlex.split(a.datagen_args),
            "datagen.log", stdout="datagen.out")
        self.t0 = time.time()
        deadline = time.monotonic() + 60
        while True:  # the topic exists once datagen created it
            try:
                marks = self.watermarks()
                break
            except (KafkaException, KeyError):
                if self.marks is not None:
                    self.marks.close()
                    self.marks = None
                self.check_alive()
                if time.monotonic() > deadline:
                    raise RuntimeError("datagen did not create the topic within 60 s") from None
                time.sleep(0.5)
        self.start_offsets = {p: low for p, (low, _h) in marks.items()}
        self.say(f"odl-datagen: {a.rate:,.0f} samples/s into {self.topic} "
                 f"({len(self.partitions)} partitions)")
        self.spawn("trainer", cli("odl-train", "odl.cli.train_cli") + [
            "--online", "--pipeline_config_path", self.config_path,
            "--edit_config_json", json.dumps(self.edits)], "trainer.log")
        self.say(f"odl-train --online started (log {self.work}/trainer.log)")
        if self.timestamps is not None:
            self.sample_follower = TopicFollower(self.bootstrap, self.topic, self.timestamps,
                                                 starts=dict(self.start_offsets),
                                                 interval_s=0.5, name="sample-timestamps")
            self.sample_follower.start()
        self.stage = "waiting for the first checkpoint" if self.delta_topic else "no serving"
        self.boundaries.append(self.sample(self.t0))
        print(self.header(), flush=True)
        end = self.t0 + 60 * a.minutes
        next_sample = self.t0 + a.interval
        next_minute = self.t0 + 60
        while True:
            now = time.time()
            if now >= min(next_sample, next_minute):
                boundary = now >= next_minute
                point = self.sample(now)
                next_sample = self.t0 + a.interval * (math.floor((now - self.t0) / a.interval)
                                                      + 1)
                if boundary:
                    self.boundaries.append(point)
                    self.minute_row(len(self.rows))
                    next_minute += 60
                    if next_minute > end + 1:
                        break
            if time.time() - self._last_watch >= 1.0:
                self.watch_procs(time.time())
            self.advance()
            self.tracker.update(self.deltas.take(), self.applies.take() if self.applies else [])
            time.sleep(max(0.0, min(0.25, min(next_sample, next_minute) - time.time())))

    def check_alive(self) -> None:
        """Raises when a process of the job has exited."""
        for role, proc in self.procs.items():
            if role == "export":
                continue
            if proc.poll() is not None:
                raise RuntimeError(f"{role} exited with code {proc.returncode} (its log: "
                                   f"{role}.log)")
        pid = self.broker_state.get("pid")
        if pid and not alive(pid):
            raise RuntimeError("the broker exited (its log: kafka/broker.log)")

    def advance(self) -> None:
        """Export once a periodic checkpoint is there, then serving (never blocks)."""
        self.check_alive()
        if self.stage == "waiting for the first checkpoint":
            ckpts = []
            if os.path.isdir(self.model_dir):
                for name in os.listdir(self.model_dir):
                    m = _CKPT_RE.match(name)
                    if m and int(m.group(1)) > 0 and os.path.exists(
                            os.path.join(self.model_dir, name, _CKPT_DONE)):
                        ckpts.append((int(m.group(1)), name))
            if not ckpts:
                return
            step, name = max(ckpts)
            self.export = {"checkpoint": name, "step": step, "started": time.time()}
            self.spawn("export", cli("odl-export", "odl.cli.export_cli") + [
                "--pipeline_config_path", self.config_path, "--edit_config_json",
                json.dumps(self.edits), "--checkpoint_path",
                os.path.join(self.model_dir, name), "--export_dir", self.export_dir],
                "export.log", stdout="export.out")
            self.stage = "exporting"
            self.say(f"checkpoint {name} is there: odl-export started")
        elif self.stage == "exporting":
            proc = self.procs["export"]
            if proc.poll() is None:
                return
            del self.procs["export"]
            if proc.returncode != 0:
                raise RuntimeError(f"odl-export exited {proc.returncode} (its log: export.log)")
            with open(os.path.join(self.work, "export.out")) as f:
                path = f.read().strip().splitlines()[-1]
            with open(os.path.join(path, KAFKA_FILE)) as f:
                kafka_txt = json.load(f)
            offset = int(kafka_txt.get("consumer", {}).get("offset", 0))
            self.export.update(path=path, seconds=round(time.time() - self.export["started"], 1),
                               replay_offset=offset)
            port = free_port()
            self.serve_url = f"http://127.0.0.1:{port}"
            self.spawn("serving", cli("odl-serve", "odl.cli.serve_cli") + [
                "--export_dir", self.export_dir, "--port", str(port)], "serving.log")
            self.delta_follower = TopicFollower(self.bootstrap, self.delta_topic, self.deltas,
                                                starts={0: offset}, interval_s=0.2, delta=True,
                                                name="delta-headers")
            self.delta_follower.start()
            self.stage = "serving starting"
            self.say(f"exported {os.path.basename(path)} in {self.export['seconds']} s "
                     f"(replay from delta offset {offset}); odl-serve started on port {port}")
        elif self.stage == "serving starting":
            if get_json(self.serve_url + "/status", timeout=2.0) is None:
                return
            self.applies = ServingApplies(self.serve_url, self.args.apply_poll)
            self.applies.start()
            self.stage = "serving"
            self.say(f"odl-serve answers at {self.serve_url}")

    def watch_procs(self, now: float) -> dict[str, Optional[float]]:
        """RSS (MiB) and CPU of every process now; RSS also into the minute's figures."""
        self._last_watch = now
        rss = self.watch.sample(self.pids())
        acc = self.rss_acc.setdefault(self.minute_of(now), {})
        for role, v in rss.items():
            if v is not None:
                a = acc.setdefault(role, [0.0, 0, 0.0, v])  # sum, count, max, min
                a[0] += v
                a[1] += 1
                a[2] = max(a[2], v)
                a[3] = min(a[3], v)
        return rss

    def sample(self, now: float) -> dict[str, Any]:
        """Reads every status and process once; appends to the timeline and returns it."""
        st = None
        if "trainer" in self.procs:
            st = trainer_json(self.model_dir, "/status", pid=self.procs["trainer"].pid)
        try:
            marks = self._marks = self.watermarks()
        except KafkaException as exc:  # the last ones; the broker's death is caught elsewhere
            logger.warning("sample topic watermarks: %s", exc)
            marks = self._marks
        if st is not None:
            self.last_trainer = st
        sv, smetrics = None, {}
        if self.stage == "serving" and self.applies is not None:
            doc, at = self.applies.last
            sv = doc if doc is not None and time.time() - at < 2.0 else get_json(
                self.serve_url + "/status", timeout=5.0)
            try:
                reply = http_request(self.serve_url + "/metrics", timeout=5.0)
                if reply.status == 200:
                    smetrics = metrics_values(reply.body.decode())
            except OSError:
                pass
        if sv is not None:
            self.last_serving = sv
        self.trainer_log.scan()
        self.serving_log.scan()
        rss = self.watch_procs(now)
        produced = sum(high - self.start_offsets.get(p, 0) for p, (_low, high) in marks.items())
        point: dict[str, Any] = {
            "t": round(now - self.t0, 2), "produced": produced,
            "low": {p: low for p, (low, _h) in marks.items()},
            "rss_mib": {r: None if v is None else round(v, 1) for r, v in rss.items()},
            "cpu_s": {r: round(v, 3) for r, v in self.watch.cpu.items()},
            "lost_logged": self.trainer_log.lost,
        }
        st = st or {}
        parts = (st.get("input") or {}).get("partitions") or {}
        pos = {int(p): int(v.get("position") or 0) for p, v in parts.items()}
        pub = st.get("publisher") or {}
        gap = None
        if pos:
            gap = max(0, sum(pos[p] - self.start_offsets.get(p, 0) for p in pos)
                      - int(st.get("samples_trained") or 0)
                      - sum((st.get("records_rejected") or {}).values()))
        point.update({
            "trainer_state": st.get("state"),
            "checkpoint_step": (st.get("last_checkpoint") or {}).get("step"),
            "trained": int(st.get("samples_trained") or 0) if st else (
                self.timeline[-1]["trained"] if self.timeline else 0),
            "lag": (sum(high - pos.get(p, self.start_offsets.get(p, 0))
                        for p, (_low, high) in marks.items()) if st else None),
            "lag_trainer": sum(int(v.get("lag") or 0) for v in parts.values()) if parts else None,
            "retention_headroom": (min(pos.get(p, 0) - low for p, (low, _h) in marks.items())
                                   if pos and marks else None),
            "position_gap": gap,
            "versions_published": pub.get("versions_published"),
            "bytes_published": pub.get("bytes_published"),
            "trainer_version": pub.get("last_version"),
            "serving_version": sv.get("version") if sv else None,
            "serving_lag_messages": sv.get("lag_messages") if sv else None,
            "serving_freshness_s": (round(sv["freshness_seconds"], 3)
                                    if sv and sv.get("freshness_seconds") is not None else None),
            "serving_offset_resets": sv.get("offset_resets") if sv else None,
            "serving_rejected": sv.get("rejected_messages") if sv else None,
            "serving_delta_lag_metric": smetrics.get("odl_serving_delta_lag"),
            "serving_versions_applied": smetrics.get("odl_serving_versions_applied_total"),
        })
        retention = (st.get("input") or {}).get("retention") or {}
        point["retention_state"] = retention.get("state")
        point["seconds_to_loss"] = retention.get("seconds_to_loss")
        point["lost_reported"] = int(retention.get("records_lost") or 0)
        point["lost"] = max(point["lost_logged"], point["lost_reported"], gap or 0,
                            self.timeline[-1]["lost"] if self.timeline else 0)
        self.timeline.append(point)
        return point

    # -- per-minute rows -------------------------------------------------------------------

    def header(self) -> str:
        """The table's two header lines."""
        kind = "exact" if self.timestamps is not None else "upper bound"
        procs = "".join(f"{r[:7]:>8}" for r in ROLES)
        w = 8 * len(ROLES)
        return (f"{'':>4}{'':>9}{'':>9}{'lag':>9}{'lag':>9}{'fresh s':>8}{'fresh s':>8}"
                f"{'':>6}{'delta':>7}{'':>6}{'':>6} | {'RSS MiB (mean)':^{w}} | "
                f"{'CPU cores':^{w}}\n"
                f"{'min':>4}{'train/s':>9}{'prod/s':>9}{'end':>9}{'max':>9}{'p50':>8}"
                f"{'p99':>8}{'ver/s':>6}{'MB/s':>7}{'lost':>6}{'vlag':>6} | {procs} | {procs}"
                f"\n(freshness: {kind}; lag and lost in records; vlag in steps)")

    def minute_row(self, i: int) -> None:
        """Prints minute ``i`` (0-based) once its end was sampled."""
        start, end = self.boundaries[i], self.boundaries[i + 1]
        inside = [s for s in self.timeline if start["t"] < s["t"] <= end["t"]]
        # versions serving applied right before the boundary: give the reader a moment
        if self.applies is not None and self.delta_follower is not None:
            deadline = time.monotonic() + 1.0
            nxt = (self.applies.last[0] or {}).get("next_offset") or 0
            while (self.delta_follower.next_offsets.get(0, 0) < nxt
                   and time.monotonic() < deadline):
                time.sleep(0.05)
            self.tracker.update(self.deltas.take(), self.applies.take())
        row = self.row(i, start, end, inside)
        self.rows.append(row)
        f = row["freshness"]
        p50, p99 = self.primary(f)
        rss = "".join(fmt(row["rss_mib"].get(r), 0, 8) for r in ROLES)
        cpu = "".join(fmt(row["cpu_cores"].get(r), 2, 8) for r in ROLES)
        print(f"{i + 1:>4}{fmt(row['train_rate'], 0, 9)}{fmt(row['produce_rate'], 0, 9)}"
              f"{fmt(row['lag_end'], 0, 9)}{fmt(row['lag_max'], 0, 9)}{fmt(p50, 3, 8)}"
              f"{fmt(p99, 3, 8)}{fmt(row['versions_per_s'], 1, 6)}"
              f"{fmt(row['delta_mb_per_s'], 2, 7)}{fmt(row['lost'], 0, 6)}"
              f"{fmt(row['version_lag'], 0, 6)} | {rss} | {cpu}", flush=True)

    def primary(self, f: dict[str, Any]) -> tuple[Optional[float], Optional[float]]:
        """The minute's freshness p50 / p99 judged: exact, else the upper bound."""
        if self.timestamps is not None:
            return f.get("exact_p50"), f.get("exact_p99")
        return f.get("upper_p50"), f.get("upper_p99")

    def row(self, i: int, start: dict, end: dict, inside: list[dict]) -> dict[str, Any]:
        """The figures of minute ``i`` between two timeline points."""
        dt = max(end["t"] - start["t"], 1e-9)

        def rate(key: str, scale: float = 1.0) -> Optional[float]:
            a, b = start.get(key), end.get(key)
            if b is None:
                return None
            return round((b - (a or 0)) / dt / scale, 3)

        lags = [s["lag"] for s in inside if s["lag"] is not None]
        acc = self.rss_acc.get(i, {})
        rss = {r: round(acc[r][0] / acc[r][1], 1) if r in acc else None for r in ROLES}
        rss_max = {r: round(acc[r][2], 1) if r in acc else None for r in ROLES}
        rss_min = {r: round(acc[r][3], 1) if r in acc else None for r in ROLES}
        sv_ok = end.get("serving_version") is not None and end.get("trainer_version") is not None
        stale = [s["serving_freshness_s"] for s in inside if s["serving_freshness_s"] is not None]
        steps = [s.get("checkpoint_step") for s in [start, *inside]]
        return {
            "minute": i + 1,
            "seconds": round(dt, 2),
            "train_rate": rate("trained"),
            "produce_rate": rate("produced"),
            "lag_end": end["lag"],
            "lag_max": max(lags) if lags else None,
            "lag_trainer_end": end["lag_trainer"],
            "freshness": self.tracker.figures(i),
            "versions_per_s": rate("versions_published"),
            "delta_mb_per_s": rate("bytes_published", MIB),
            "lost": end["lost"] - start["lost"],
            "lost_total": end["lost"],
            "version_lag": end["trainer_version"] - end["serving_version"] if sv_ok else None,
            "serving_lag_messages": end["serving_lag_messages"],
            "serving_staleness_max_s": max(stale) if stale else None,
            # checkpoints written in the minute (each copies the state at its step)
            "checkpoints": sum(1 for a, b in zip(steps, steps[1:], strict=False)
                               if b is not None and b != a),
            "retention_headroom_min": min((s["retention_headroom"] for s in inside
                                           if s["retention_headroom"] is not None),
                                          default=None),
            "rss_mib": rss,
            "rss_mib_max": rss_max,
            "rss_mib_min": rss_min,
            "cpu_cores": {r: round((end["cpu_s"][r] - start["cpu_s"][r]) / dt, 3)
                          for r in ROLES},
        }

    # -- the end ---------------------------------------------------------------------------

    def teardown(self) -> None:
        """Stops everything, in order, and checks that nothing is left (each step runs even
        when an earlier one failed)."""
        previous = {s: signal.signal(s, lambda *_: print(
            "[soak] stopping everything, please wait", flush=True))
            for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        rep: dict[str, Any] = {}
        left: list[str] = []

        def step(name: str, fn: Any) -> None:
            try:
                out = fn()
                if out is not None:
                    rep[name] = out
            except Exception as exc:  # noqa: BLE001 - go on stopping the rest
                rep[name] = {"failed": f"{type(exc).__name__}: {exc}"}
                print(f"[soak] stopping {name} failed: {exc}", flush=True)

        def threads() -> None:
            for t in (self.applies, self.delta_follower, self.sample_follower):
                if t is not None:
                    t.stop()
            if self.marks is not None:
                self.marks.close()
            if self.applies is not None:
                self.tracker.update(self.deltas.take(), self.applies.take())

        def datagen() -> Optional[dict[str, Any]]:
            gen = self.procs.get("datagen")
            if gen is None:
                return None
            out = self.stop(gen, signal.SIGTERM, 60)
            try:
                with open(os.path.join(self.work, "datagen.out")) as f:
                    self.datagen_summary = json.loads(f.read().strip().splitlines()[-1])
            except (OSError, ValueError, IndexError):
                pass
            return out

        def trainer() -> Optional[dict[str, Any]]:
            tr = self.procs.get("trainer")
            if tr is None:
                return None
            if self.stop_signal and tr.poll() is None and os.path.isdir(self.model_dir):
                Path(self.model_dir, "OSS_STOP_SIGNAL").touch()
                out = self.stop(tr, None, self.stop_poll + 120)
                out["how"] = "OSS_STOP_SIGNAL"
                return out
            return self.stop(tr, signal.SIGTERM, 120)

        def other(role: str, timeout: float) -> Optional[dict[str, Any]]:
            proc = self.procs.get(role)
            return None if proc is None else self.stop(proc, signal.SIGTERM, timeout)

        def broker() -> Optional[dict[str, Any]]:
            if not self.broker_state and not os.path.exists(
                    os.path.join(self.kafka_dir, "broker.json")):
                return None
            return {"down": kafka_cli("down", "--data-dir", self.kafka_dir,
                                      timeout=180).stdout.strip()}

        def running(proc: psutil.Process) -> Optional[str]:
            try:
                st = proc.status()
                return st if proc.is_running() and st != psutil.STATUS_ZOMBIE else None
            except psutil.Error:
                return None

        def leftovers() -> None:
            deadline = time.monotonic() + 10.0  # a process may still be exiting
            while (any(running(p) for p in self.owned.values())
                   and time.monotonic() < deadline):
                time.sleep(0.2)
            for name, proc in self.owned.items():
                st = running(proc)
                if st:
                    left.append(f"{name} (pid {proc.pid}, {st})")
                    try:
                        proc.kill()
                    except psutil.Error:
                        pass

        try:
            step("threads", threads)
            step("datagen", datagen)
            step("export", lambda: other("export", 30))
            step("trainer", trainer)
            step("serving", lambda: other("serving", 30))
            step("broker", broker)
            step("leftovers", leftovers)
            rep["left_running"] = left
            self.load_after = os.getloadavg()
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
        self.teardown_report = rep
        self.say("everything stopped" + (f"; KILLED leftovers: {', '.join(left)}"
                                          if left else "; no process left"))

    @staticmethod
    def stop(proc: subprocess.Popen, sig: Optional[int], timeout: float) -> dict[str, Any]:
        """Signals a process (None: it was asked otherwise), waits, SIGKILLs after timeout."""
        t = time.monotonic()
        killed = False
        if proc.poll() is None:
            if sig is not None:
                proc.send_signal(sig)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
                killed = True
        return {"exit_code": proc.returncode, "seconds": round(time.monotonic() - t, 1),
                "killed": killed}

    def result(self) -> dict[str, Any]:
        """Everything measured, the summary and the checks."""
        a = self.args
        self.tracker.update(self.deltas.take(), [])
        for i, row in enumerate(self.rows):  # versions resolved after the row was printed
            row["freshness"] = self.tracker.figures(i)
        steady = [r for r in self.rows if r["minute"] > a.warmup_minutes]
        first_s = self.t0
        summary: dict[str, Any] = {"steady_minutes": len(steady)}
        checks: dict[str, Optional[bool]] = {}
        if steady:
            lags = [r["lag_max"] for r in steady if r["lag_max"] is not None]
            p99s = [self.primary(r["freshness"])[1] for r in steady]
            known = [p for p in p99s if p is not None]
            rss_growth = {}
            for role in ROLES:
                a0 = steady[0]["rss_mib"].get(role)
                a1 = steady[-1]["rss_mib"].get(role)
                rss_growth[role] = round(100.0 * (a1 - a0) / a0, 1) if a0 and a1 else None
            # the floor (each minute's lowest sample): memory kept, without transient peaks
            # such as the embedded broker's saves (a sawtooth around a minute's mean)
            floor_growth = {}
            for role in ROLES:
                f0 = steady[0]["rss_mib_min"].get(role)
                f1 = steady[-1]["rss_mib_min"].get(role)
                floor_growth[role] = round(100.0 * (f1 - f0) / f0, 1) if f0 and f1 else None
            t_a = self.boundaries[a.warmup_minutes]
            t_b = self.boundaries[len(self.rows)]
            dn = t_b["trained"] - t_a["trained"]
            dt = max(t_b["t"] - t_a["t"], 1e-9)
            cpu_tr = t_b["cpu_s"]["trainer"] - t_a["cpu_s"]["trainer"]
            cpu_in = t_b["cpu_s"]["input"] - t_a["cpu_s"]["input"]
            steady_fresh = self.tracker.overall(r["minute"] - 1 for r in steady)
            summary.update({
                "lag_max": max(lags) if lags else None,
                "freshness_p99_worst_minute_s": max(known) if known else None,
                "freshness_steady": steady_fresh,
                "minutes_without_versions": sum(1 for p in p99s if p is None),
                "records_lost_total": self.rows[-1]["lost_total"],
                "records_lost_steady": sum(r["lost"] for r in steady),
                "rss_growth_pct": rss_growth,
                "rss_floor_growth_pct": floor_growth,
                "train_rate": round(dn / dt, 1),
                "produce_rate": round((t_b["produced"] - t_a["produced"]) / dt, 1),
                "trainer_cores": round(cpu_tr / dt, 3),
                "input_cores": round(cpu_in / dt, 3),
                "trainer_cores_per_10k_samples_per_s": (round((cpu_tr + cpu_in) * 1e4 / dn, 3)
                                                        if dn > 0 else None),
                "trainer_only_cores_per_10k_samples_per_s": (round(cpu_tr * 1e4 / dn, 3)
                                                             if dn > 0 else None),
                "version_lag_max": max((r["version_lag"] for r in steady
                                        if r["version_lag"] is not None), default=None),
                "retention_headroom_min": min((r["retention_headroom_min"] for r in steady
                                               if r["retention_headroom_min"] is not None),
                                              default=None),
            })
            checks["lag < 20k after warm-up"] = bool(lags) and max(lags) < LAG_TARGET
            checks["freshness p99 <= 1 s every minute"] = (
                len(known) == len(p99s) and max(known) <= P99_TARGET_S)
            checks["nothing lost to retention"] = self.rows[-1]["lost_total"] == 0
            growth = [rss_growth[r] for r in CHECKED_ROLES]
            checks["RSS flat within +-10 %"] = (
                len(steady) >= 2 and all(g is not None and abs(g) <= 100 * RSS_TOLERANCE
                                         for g in growth))
        resets = (self.last_serving or {}).get("offset_resets")
        summary["serving_offset_resets"] = resets
        summary["serving_rejected_messages"] = (self.last_serving or {}).get("rejected_messages")
        if self.last_serving is not None:
            checks["serving replayed every version (no offset resets)"] = resets == 0
        overall = bool(checks) and all(checks.values()) and not self.interrupted \
            and self.failure is None and len(self.rows) >= a.minutes
        return {
            "verdict": "PASS" if overall else "FAIL",
            "checks": checks,
            "summary": summary,
            "rows": self.rows,
            "timeline": self.timeline,
            "versions": self.tracker.versions,
            "versions_columns": ["apply_unix_s", "version", "samples", "upper_bound_s",
                                 "lower_bound_s", "publish_to_apply_s"],
            "freshness_method": ("exact per sample (produce timestamps read back)"
                                 if self.timestamps is not None else
                                 "per-version upper bound (apply - min produce time), "
                                 "sample-weighted"),
            "freshness_reader": {
                "delta_messages": self.delta_follower.messages if self.delta_follower else 0,
                "delta_resets": self.delta_follower.resets if self.delta_follower else 0,
                "unparsable": self.deltas.unparsable,
                "incomplete_dropped": self.deltas.dropped_incomplete,
                "pending_at_end": self.tracker.pending,
                "unresolved_dropped": self.tracker.unresolved_dropped,
                "apply_polls": self.applies.polls if self.applies else 0,
                "apply_poll_failures": self.applies.failures if self.applies else 0,
                "sample_messages": (self.sample_follower.messages if self.sample_follower
                                    else None),
                "timestamp_runs_held": self.timestamps.runs if self.timestamps else None,
            },
            "args": vars(a),
            "stream_start_unix_s": round(first_s, 3),
            "bootstrap": self.bootstrap,
            "topics": {"samples": self.topic, "deltas": self.delta_topic},
            "config_edits": self.edits,
            "commands": self.commands,
            "export": self.export,
            "broker": self.broker_state,
            "datagen_summary": self.datagen_summary,
            "trainer_log": {"errors": self.trainer_log.errors,
                            "records_deleted_logged": self.trainer_log.lost},
            "serving_log_errors": self.serving_log.errors,
            "last_trainer_status": self.last_trainer,
            "last_serving_status": self.last_serving,
            "teardown": self.teardown_report,
            "interrupted": self.interrupted,
            "failure": self.failure,
            "work_dir": self.work if a.keep_dir else None,
            "cpu_count": os.cpu_count(),
            "load_average": {"before": [round(x, 2) for x in self.load_before],
                             "after": [round(x, 2) for x in self.load_after]
                             if self.load_after else None},
        }

    def print_summary(self, res: dict[str, Any]) -> None:
        """The summary lines."""
        s = res["summary"]
        a = self.args
        print(f"\n== summary: {len(self.rows)} of {a.minutes} minutes at {a.rate:,.0f} "
              f"samples/s asked; steady state = after minute {a.warmup_minutes} "
              f"({s['steady_minutes']} minutes)")
        if s["steady_minutes"]:
            fresh = s["freshness_steady"]
            kind = "exact" if self.timestamps is not None else "upper bound"
            print(f"rates: produced {s['produce_rate']:,.0f}/s, trained {s['train_rate']:,.0f}/s")
            if s["produce_rate"] < 0.95 * a.rate or s["train_rate"] < 0.95 * s["produce_rate"]:
                print("NOTE: this machine did not sustain the asked rate through datagen + "
                      "broker + trainer + serving; the figures are at the achieved rate")
            print(f"max lag {fmt(s['lag_max'], 0, 0)} records (target < {LAG_TARGET:,})")
            print(f"freshness ({kind}): worst minute p99 "
                  f"{fmt(s['freshness_p99_worst_minute_s'], 3, 0)} s (target <= {P99_TARGET_S} "
                  f"s), {s['minutes_without_versions']} minutes without an applied version; "
                  f"steady overall p50 {fresh.get('exact_p50', fresh['upper_p50'])} s, p99 "
                  f"{fresh.get('exact_p99', fresh['upper_p99'])} s (per-version bounds: p99 "
                  f"between {fresh['lower_p99']} and {fresh['upper_p99']} s)")
            print(f"records lost to retention: {s['records_lost_total']:,} "
                  f"({s['records_lost_steady']:,} in steady state); smallest retention "
                  f"headroom (trained position - log start) {fmt(s['retention_headroom_min'])}")
            print("RSS growth first -> last steady minute: " + ", ".join(
                f"{r} {'-' if g is None else f'{g:+.1f} %'}"
                for r, g in s["rss_growth_pct"].items()) + " (bench not judged)")
            print("RSS floor (each minute's lowest sample) growth: " + ", ".join(
                f"{r} {'-' if g is None else f'{g:+.1f} %'}"
                for r, g in s["rss_floor_growth_pct"].items()))
            print(f"trainer CPU: {s['trainer_cores']} cores + input process "
                  f"{s['input_cores']} = {s['trainer_cores_per_10k_samples_per_s']} cores per "
                  f"10k samples/s ({s['trainer_only_cores_per_10k_samples_per_s']} without the "
                  f"input process) on {os.cpu_count()} cores")
        print(f"serving: delta replay offset resets {s['serving_offset_resets']}, rejected "
              f"messages {s['serving_rejected_messages']}")
        lb, la = res["load_average"]["before"], res["load_average"]["after"]
        print(f"load average before {lb}, after {la}")
        for name, ok in res["checks"].items():
            print(f"  {'PASS' if ok else 'FAIL'}  {name}")
        why = ("interrupted" if self.interrupted else "failed: " + self.failure.splitlines()[0]
               if self.failure else "")
        print(f"== {res['verdict']}" + (f" ({why})" if why else ""), flush=True)


def plot_soak(path: str, res: dict[str, Any]) -> None:
    """Lag, rates, freshness p99 and RSS per process over the run (bench_plots style)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a = res["args"]
    tl = res["timeline"]
    x = [p["t"] / 60 for p in tl]
    fig, axes = plt.subplots(4, 1, figsize=(8.0, 10.5), sharex=True)
    ax = axes[0]
    ax.plot(x, [p["lag"] if p["lag"] is not None else float("nan") for p in tl],
            label="lag (records)", lw=1.4)
    ax.axhline(LAG_TARGET, color="#c44", lw=0.8, ls="--", label="target")
    ax.set_ylabel("records")
    ax = axes[1]
    rates: dict[str, list[float]] = {"trained": [], "produced": []}
    for prev, cur in zip(tl, tl[1:], strict=False):
        dt = max(cur["t"] - prev["t"], 1e-9)
        rates["trained"].append((cur["trained"] - prev["trained"]) / dt)
        rates["produced"].append((cur["produced"] - prev["produced"]) / dt)
    for name, ys in rates.items():
        ax.plot(x[1:], ys, label=f"{name} samples/s", lw=1.2)
    ax.axhline(a["rate"], color="#bbb", lw=0.8, ls="--", label="asked")
    ax.set_ylabel("samples/s")
    ax = axes[2]
    exact = res["freshness_method"].startswith("exact")
    mx = [r["minute"] - 0.5 for r in res["rows"]]

    def col(key: str) -> list[float]:
        return [float("nan") if r["freshness"].get(key) is None else r["freshness"][key]
                for r in res["rows"]]

    if exact:
        ax.plot(mx, col("exact_p99"), marker="o", label="p99 (exact)")
        ax.plot(mx, col("exact_p50"), marker=".", label="p50 (exact)")
    ax.plot(mx, col("upper_p99"), marker="o" if not exact else "x",
            label="p99 upper bound")
    ax.plot(mx, col("lower_p99"), ls=":", label="p99 lower bound")
    if not exact:
        ax.plot(mx, col("upper_p50"), marker=".", label="p50 upper bound")
    ax.axhline(P99_TARGET_S, color="#c44", lw=0.8, ls="--", label="target")
    shown = [v for v in col("upper_p99") + col("upper_p50") if v == v and v > 0]
    if shown and max(shown) / min(shown) > 20:
        from matplotlib.ticker import FormatStrFormatter, NullFormatter

        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylabel("produce → served (s)")
    ax = axes[3]
    for role in ROLES:
        ys = [p["rss_mib"].get(role) for p in tl]
        ax.plot(x, [float("nan") if v is None else v for v in ys], label=role, lw=1.2)
    ax.set_ylabel("RSS (MiB)")
    ax.set_xlabel("minutes since the stream started")
    for ax in axes:
        ax.axvspan(0, a["warmup_minutes"], color="#eee", zorder=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_title(f"soak: {a['rate']:,.0f} samples/s asked, {os.path.basename(a['config'])}"
                      f", {res['verdict']} (grey: warm-up)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=int, default=30)
    ap.add_argument("--rate", type=float, default=10000.0, help="samples/s produced")
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--config", default=os.path.join(REPO, "samples", "deepfm_online.config"))
    ap.add_argument("--warmup-minutes", type=int, default=5)
    ap.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    ap.add_argument("--apply-poll", type=float, default=0.1,
                    help="seconds between two polls of serving's /status for applied versions")
    ap.add_argument("--exact-freshness", action="store_true",
                    help="also read the sample topic's produce timestamps: per-sample "
                         "freshness instead of the per-version upper bound")
    ap.add_argument("--broker-args", default="",
                    help="more odl-kafka up arguments (e.g. '--retention_mb 32'; default: "
                         "its defaults, as a user runs it)")
    ap.add_argument("--delta-retention-mb", type=float, default=128.0,
                    help="create the config's delta topic first with this retention "
                         "(odl-kafka create-topic), as the docs ask: it must keep the versions "
                         "since the newest checkpoint and export; 0: leave it to the trainer "
                         "and odl-kafka up's default")
    ap.add_argument("--datagen-args", default="",
                    help="more odl-datagen arguments (e.g. '--conversions' for a multi-task "
                         "config)")
    ap.add_argument("--json", help="write everything here")
    ap.add_argument("--plot", help="write the plot here (PNG)")
    ap.add_argument("--keep-dir", action="store_true",
                    help="keep the work directory (broker data, model_dir, export, logs)")
    args = ap.parse_args()
    if args.minutes < 1 or args.interval <= 0 or args.interval > 60:
        ap.error("--minutes >= 1 and 0 < --interval <= 60")
    setup_logging("WARNING")
    work = tempfile.mkdtemp(prefix="odl-soak-")

    def interrupt(signum: int, _frame: Any) -> None:
        raise Interrupted(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGHUP, interrupt)
    soak = Soak(args, work)
    try:
        soak.run()
    except (KeyboardInterrupt, Interrupted) as exc:
        soak.interrupted = True
        print(f"\n[soak] interrupted ({type(exc).__name__} {exc}): stopping", flush=True)
    except Exception as exc:  # report, stop everything, keep the partial figures
        soak.failure = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
        for log in ("trainer.log", "serving.log", "datagen.log", "export.log",
                    os.path.join("kafka", "broker.log")):
            tail = log_tail(os.path.join(work, log), 8)
            if tail:
                print(f"--- {log} (last lines)\n{tail}", flush=True)
    finally:
        soak.teardown()
    res = soak.result()
    if soak.rows:
        soak.print_summary(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
        print(f"json: {args.json}")
    if args.plot and soak.rows:
        plot_soak(args.plot, res)
        print(f"plot: {args.plot}")
    if args.keep_dir:
        print(f"work dir kept: {work}")
    else:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return 0 if res["verdict"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
