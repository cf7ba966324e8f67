"""``odl-serve`` memory under a flood of oversized ``/predict`` uploads.

One run, one machine, a real ``odl-serve`` process (uvicorn on 127.0.0.1, ``--no_replay``) on a
small DeepFM export (8 id features of dim 8 x 1,000 buckets, 13 dense, DNN 32-16), its
resident memory (RSS, psutil) sampled every 10 ms:

1. **before**: after a warm-up of single-record and 256-record predictions;
2. **flood**: ``--clients`` (20) concurrent uploads of ``--mib`` (200) MiB each, half with a
   ``Content-Length`` header and half chunked, each client sending 1 MiB at a time and
   reading the answer as soon as there is one (as curl does); the peak RSS while they run,
   each client's answer (413 expected, or a reset connection) and how much it had sent;
3. **accepted**: ``--accepted-clients`` (20) concurrent valid bodies of ``--accepted-mib``
   (8) MiB of CSV records each, within ``--max_body_bytes``: the in-flight byte bound
   (64 MiB by default) admits a few at a time, the others get 503 and retry after
   ``Retry-After``; the peak RSS while they run;
4. **after** each phase: RSS once the server is idle again (no request in flight,
   ``odl_serving_predict_inflight_bytes`` 0, one more second) and a single-record
   ``/predict`` that must answer 200.

``--compare-no-trim`` runs phase 3 again on a second ``odl-serve`` whose heap trimming
(glibc ``malloc_trim`` after large bodies) is switched off, to show what the trim gives back.

    .venv/bin/python bench/predict_upload_flood.py [--clients 20] [--mib 200]
        [--accepted-clients 20] [--accepted-mib 8] [--compare-no-trim] [--json out.json] [--keep]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import psutil  # noqa: E402

from bench.run_output import add_output_args, finish_run  # noqa: E402
from odl.checkpoint.checkpoint_manager import CheckpointManager  # noqa: E402
from odl.cli.cli_logging import setup_logging
from odl.config.config_redaction import config_to_text  # noqa: E402
from odl.config.pipeline_config import parse_pipeline_config_text  # noqa: E402
from odl.datagen.datagen_config import deepfm_config_text  # noqa: E402
from odl.datagen.synthetic_ctr import SyntheticCtrStream  # noqa: E402
from odl.export.exporter import export_checkpoint  # noqa: E402
from odl.features.feature_builder import FeatureBuilder  # noqa: E402
from odl.harness.http_client import free_port  # noqa: E402
from odl.train.train_module import TrainModule  # noqa: E402

MIB = 1 << 20
PIECE = MIB

# The odl-serve child: the real CLI, optionally with heap trimming switched off.
SERVE = r"""
import sys
if sys.argv[1] == "no-trim":
    from serving_plugin import predict_limits
    predict_limits.MemoryTrimmer.request = lambda self: None
from odl.cli.serve_cli import main
sys.exit(main(sys.argv[2:]))
"""


def build_export(work: str) -> str:
    """Trains a small DeepFM two steps and exports it (no delta topic)."""
    model_dir = os.path.join(work, "model_dir")
    config = parse_pipeline_config_text(deepfm_config_text(
        model_dir, batch_size=256, dim=8, buckets=1000,
        sparse_fields=tuple(f"C{i}" for i in range(1, 9))))
    fb = FeatureBuilder(config)
    tm = TrainModule(config, fb, device="cpu")
    stream = SyntheticCtrStream(seed=5)
    for _ in range(2):
        tm.train_step(fb.build(stream.next_batch(256).encode("csv")).batch)
    ckpt = CheckpointManager(model_dir).save(
        tm.global_step, tm.state_dict_for_checkpoint(), {0: 0},
        {"source": "kafka", "topic": "samples"}, config_to_text(config), generation="bench")
    return export_checkpoint(config, ckpt, os.path.join(work, "exports")).path


class Server:
    """An ``odl-serve`` child process and an RSS sampler.

    Args:
        export: the export directory.
        work: where its log goes.
        trim: False switches heap trimming off (for the comparison).
    """

    def __init__(self, export: str, work: str, trim: bool = True) -> None:
        self.port = free_port()
        self.log_path = os.path.join(work, f"odl-serve-{self.port}.log")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVE, "trim" if trim else "no-trim", "--export_dir", export,
             "--no_replay", "--port", str(self.port), "--log_level", "WARNING",
             "--torch_threads", "1"],
            stdout=self._log, stderr=subprocess.STDOUT,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        self.ps = psutil.Process(self.proc.pid)
        self.peak = 0
        self._stop = threading.Event()
        self._sampler: Optional[threading.Thread] = None
        deadline = time.monotonic() + 180
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"odl-serve exited: see {self.log_path}")
            if time.monotonic() > deadline:
                raise RuntimeError("odl-serve did not come up")
            try:
                if get(self.port, "/healthz")[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.1)

    def rss(self) -> int:
        return self.ps.memory_info().rss

    def start_peak(self) -> None:
        """Samples RSS every 10 ms into ``peak`` until ``stop_peak``."""
        self.peak = self.rss()
        self._stop.clear()

        def run() -> None:
            while not self._stop.wait(0.01):
                try:
                    self.peak = max(self.peak, self.rss())
                except psutil.Error:
                    return

        self._sampler = threading.Thread(target=run, daemon=True)
        self._sampler.start()

    def stop_peak(self) -> int:
        self._stop.set()
        assert self._sampler is not None
        self._sampler.join()
        return max(self.peak, self.rss())

    def settled_rss(self, timeout: float = 60.0) -> int:
        """RSS once nothing is in flight any more, plus one second."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = metrics(self.port)
            if (m.get("odl_serving_predict_inflight_requests", 0) == 0
                    and m.get("odl_serving_predict_inflight_bytes", 0) == 0):
                break
            time.sleep(0.05)
        time.sleep(1.0)
        return self.rss()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


def get(port: int, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def post(port: int, body: bytes) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.request("POST", "/predict", body=body)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def metrics(port: int) -> dict[str, float]:
    """The unlabelled samples of /metrics."""
    out = {}
    for line in get(port, "/metrics")[1].decode().splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.partition(" ")
            out[name] = float(value)
    return out


def upload(port: int, total: int, chunked: bool, barrier: threading.Barrier) -> dict[str, Any]:
    """Sends a ``total``-byte body 1 MiB at a time, stopping as soon as an answer arrives."""
    piece = b"9" * PIECE
    framed = b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece
    head = ("POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            + ("Transfer-Encoding: chunked\r\n" if chunked else f"Content-Length: {total}\r\n")
            + "\r\n").encode()
    barrier.wait()
    t0 = time.perf_counter()
    sent = 0
    outcome: dict[str, Any] = {"chunked": chunked}
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    try:
        try:
            sock.sendall(head)
            while sent < total and not select.select([sock], [], [], 0)[0]:
                sock.sendall(framed)
                sent += PIECE
            if sent >= total and chunked:
                sock.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            outcome["send_error"] = True
        try:
            resp = http.client.HTTPResponse(sock)
            resp.begin()
            resp.read()
            outcome["status"] = resp.status
        except (ConnectionResetError, http.client.RemoteDisconnected, OSError):
            outcome["status"] = "reset"
    finally:
        sock.close()
    outcome["sent_mib"] = sent / MIB
    outcome["seconds"] = time.perf_counter() - t0
    return outcome


def flood(srv: Server, clients: int, mib: int) -> dict[str, Any]:
    """Phase 2: concurrent oversized uploads."""
    barrier = threading.Barrier(clients)
    results: list[dict] = [{} for _ in range(clients)]

    def run(i: int) -> None:
        results[i] = upload(srv.port, mib * MIB, chunked=i % 2 == 1, barrier=barrier)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    srv.start_peak()
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    secs = time.perf_counter() - t0
    peak = srv.stop_peak()
    codes: dict[str, int] = {}
    for r in results:
        key = f"{'chunked' if r['chunked'] else 'content_length'}:{r['status']}"
        codes[key] = codes.get(key, 0) + 1
    return {"peak_rss": peak, "seconds": round(secs, 2), "answers": codes,
            "max_sent_mib": {k: max(r["sent_mib"] for r in results if r["chunked"] == c)
                             for k, c in (("content_length", False), ("chunked", True))},
            "max_answer_seconds": round(max(r["seconds"] for r in results), 3)}


def accepted(srv: Server, clients: int, body: bytes) -> dict[str, Any]:
    """Phase 3: concurrent valid large bodies, retried on 503."""
    out: list[dict] = [{} for _ in range(clients)]
    barrier = threading.Barrier(clients)

    def run(i: int) -> None:
        barrier.wait()
        retries = 0
        while True:
            code, headers, _ = post(srv.port, body)
            if code != 503 or retries >= 200:
                break
            retries += 1
            time.sleep(float(headers.get("retry-after", "1")))
        out[i] = {"status": code, "retries": retries}

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    srv.start_peak()
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    secs = time.perf_counter() - t0
    peak = srv.stop_peak()
    return {"peak_rss": peak, "seconds": round(secs, 2),
            "ok": sum(r["status"] == 200 for r in out),
            "retries_503": sum(r["retries"] for r in out)}


def mib(n: float) -> float:
    return round(n / MIB, 1)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--mib", type=int, default=200, help="size of each oversized upload")
    ap.add_argument("--accepted-clients", type=int, default=20)
    ap.add_argument("--accepted-mib", type=float, default=8.0,
                    help="size of each valid body (within --max_body_bytes)")
    ap.add_argument("--accepted-rounds", type=int, default=2,
                    help="bursts of valid bodies, one after the other (RSS must not creep)")
    ap.add_argument("--compare-no-trim", action="store_true",
                    help="repeat phase 3 on a server without heap trimming")
    add_output_args(ap)
    args = ap.parse_args(argv)
    setup_logging("WARNING")
    work = tempfile.mkdtemp(prefix="odl-bench-flood-")
    export = build_export(work)
    stream = SyntheticCtrStream(seed=9)
    one = stream.next_batch(1).encode("csv")[0]
    batch256 = b"\n".join(stream.next_batch(256).encode("csv"))
    records: list[bytes] = []
    size = 0
    while size < args.accepted_mib * MIB:
        recs = stream.next_batch(4096).encode("csv")
        records.extend(recs)
        size += sum(len(r) + 1 for r in recs)
    big = b"\n".join(records)[: int(args.accepted_mib * MIB)]
    big = big[: big.rfind(b"\n")]  # whole records only
    n_big = big.count(b"\n") + 1
    del records
    load_before = os.getloadavg()

    def run_server(trim: bool, phases: tuple[str, ...]) -> dict[str, Any]:
        srv = Server(export, work, trim=trim)
        try:
            for _ in range(50):
                assert post(srv.port, one)[0] == 200
            for _ in range(5):
                assert post(srv.port, batch256)[0] == 200
            res: dict[str, Any] = {"rss_before_mib": mib(srv.settled_rss())}
            if "flood" in phases:
                f = flood(srv, args.clients, args.mib)
                peak = f.pop("peak_rss")
                after = srv.settled_rss()
                res["flood"] = {**f, "peak_rss_mib": mib(peak),
                                "rss_after_mib": mib(after),
                                "predict_after": post(srv.port, one)[0]}
            if "accepted" in phases:
                rounds = []
                for _ in range(args.accepted_rounds):
                    a = accepted(srv, args.accepted_clients, big)
                    peak = a.pop("peak_rss")
                    after = srv.settled_rss()
                    rounds.append({**a, "peak_rss_mib": mib(peak), "rss_after_mib": mib(after),
                                   "predict_after": post(srv.port, one)[0]})
                res["accepted"] = rounds
            m = metrics(srv.port)
            res["client_disconnects"] = m.get("odl_serving_predict_client_disconnects_total")
            with open(srv.log_path, "rb") as f:
                res["traceback_in_log"] = b"Traceback" in f.read()
            return res
        finally:
            srv.stop()

    result: dict[str, Any] = {
        "clients": args.clients, "upload_mib": args.mib,
        "accepted_clients": args.accepted_clients,
        "accepted_body_mib": mib(len(big)), "accepted_body_records": n_big,
        "server": run_server(True, ("flood", "accepted")),
    }
    if args.compare_no_trim:
        result["server_without_trim"] = run_server(False, ("accepted",))
    result["load_average"] = {"before": [round(x, 2) for x in load_before],
                              "after": [round(x, 2) for x in os.getloadavg()]}
    print(json.dumps(result, indent=1))
    s = result["server"]
    f = s["flood"]
    print(f"RSS before: {s['rss_before_mib']} MiB")
    print(f"{args.clients} x {args.mib} MiB uploads: peak {f['peak_rss_mib']} MiB, after "
          f"{f['rss_after_mib']} MiB; answers {f['answers']}; at most "
          f"{f['max_sent_mib']} MiB sent before the answer; /predict after: "
          f"{f['predict_after']}")
    for name, srv in (("", s), (" without heap trimming", result.get("server_without_trim"))):
        for i, a in enumerate(srv["accepted"] if srv else []):
            print(f"{args.accepted_clients} x {result['accepted_body_mib']} MiB valid bodies "
                  f"({n_big} records), burst {i + 1}{name}: peak {a['peak_rss_mib']} MiB, "
                  f"after {a['rss_after_mib']} MiB; {a['ok']} answered 200 after "
                  f"{a['retries_503']} 503 retries")
    print(f"tracebacks in the server log: {s['traceback_in_log']}")
    finish_run(args, result, work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
