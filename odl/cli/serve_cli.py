"""``odl-serve``: serves the newest export and keeps it fresh by replaying the delta topic.

Examples::

    odl-serve --export_dir exports --port 8500
    odl-serve --export_dir exports/1767225600 --no_replay
    odl-serve --export_dir saves/20261124/base --delta_dir saves
    odl-serve --export_dir exports --disk_tier_dir /data/odl-serve-tier --ram_rows 4000000

Loads the newest complete export under ``--export_dir`` (see ``odl.export.exporter``),
replays the delta topic from ``kafka.txt``'s offset (or, with ``--delta_dir``, a file
stream's day/pass deltas after the base's day), and answers ``POST /predict``,
``GET /status``, ``GET /healthz`` and ``GET /metrics`` (see ``serving_plugin``). Runs until
SIGTERM / SIGINT. With ``--disk_tier_dir`` every dynamic table that may hold more than
``--ram_rows`` ids keeps that many rows in RAM and the rest on local disk
(``serving_plugin.serving_tier``). Exit codes: 0 clean stop; 2 bad command line (a bad
``/predict`` limit or disk tier option, an unusable ``--auth_token_file``), no usable export,
or a disk tier directory in use.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from typing import Optional

from odl.cli.cli_logging import setup_logging
from odl.cli.oss_arguments import add_oss_arguments, apply_oss_arguments

logger = logging.getLogger("odl.serve")


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser."""
    p = argparse.ArgumentParser(prog="odl-serve",
                                description="Serve an exported model with delta replay.")
    p.add_argument("--export_dir", required=True,
                   help="an export, or a directory of exports (the newest complete one)")
    p.add_argument("--port", type=int, default=8500, help="HTTP port (0 = any free port)")
    p.add_argument("--host", default="127.0.0.1",
                   help="bind address; another than loopback should come with --auth_token_file")
    p.add_argument("--auth_token_file", default="",
                   help="file holding a bearer token required on every endpoint but /healthz "
                        "(default: env ODL_AUTH_TOKEN; none = open)")
    p.add_argument("--no_replay", action="store_true", help="serve the base only")
    p.add_argument("--delta_dir", default="",
                   help="a file stream's model_save_path: apply its <day>/delta_<pass> "
                        "directories after the base's day, in order, instead of the delta topic")
    p.add_argument("--delta_after_day", default="",
                   help="YYYYMMDD: apply the deltas of the days after this one (default: the "
                        "day of --export_dir's <root>/<day>/base path)")
    p.add_argument("--delta_poll_secs", type=float, default=5.0,
                   help="seconds between two looks for new delta directories (default 5)")
    p.add_argument("--kafka_server", default="", help="delta servers instead of kafka.txt's")
    p.add_argument("--kafka_config", default="",
                   help='extra librdkafka settings as JSON, e.g. {"security.protocol": "SSL"}')
    p.add_argument(
        "--fetch_interval_ms", type=int, default=10,
        help="delta consumer fetch pacing: refetch at most this often while messages are "
             "queued; 0 = librdkafka's own pacing",
    )
    p.add_argument("--max_body_bytes", type=int, default=16 << 20,
                   help="largest /predict body (default 16 MiB); larger ones get 413, by "
                        "Content-Length before any of the body is read, or as soon as a "
                        "chunked body passes it")
    p.add_argument("--max_inflight_requests", type=int, default=64,
                   help="most /predict requests read or answered at once (default 64); "
                        "more get 503 with Retry-After")
    p.add_argument("--max_inflight_bytes", type=int, default=64 << 20,
                   help="most /predict body bytes held at once, all requests together "
                        "(default 64 MiB, at least --max_body_bytes); more get 503 with "
                        "Retry-After")
    p.add_argument("--body_timeout_s", type=float, default=30.0,
                   help="longest time to receive one /predict body (default 30; 0 = no "
                        "limit); slower ones get 408")
    p.add_argument("--no_verify", action="store_true",
                   help="skip checking the embedding shards' sha256 at load")
    p.add_argument(
        "--torch_threads", type=int, default=0,
        help="torch intra-op threads; 0 = half of the CPUs (leaves room for input and I/O)",
    )
    p.add_argument("--disk_tier_dir", default="",
                   help="serve dynamic tables larger than --ram_rows from RAM and this local "
                        "directory (scratch, rebuilt from the export at start; one odl-serve "
                        "per directory); default: every row in RAM")
    p.add_argument("--ram_rows", type=int, default=1 << 20,
                   help="with --disk_tier_dir: rows each such table keeps in RAM (default "
                        "1048576); the others are on disk")
    p.add_argument("--max_disk_rows", type=int, default=0,
                   help="with --disk_tier_dir: the most rows of one table on disk (default 0: "
                        "while the disk keeps 1 GiB free)")
    add_oss_arguments(p)
    p.add_argument("--log_level", default="INFO")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of ``odl-serve``."""
    args = build_parser().parse_args(argv)
    apply_oss_arguments(args)
    setup_logging(args.log_level)
    extra = {}
    if args.kafka_config:
        try:
            extra = {str(k): str(v) for k, v in json.loads(args.kafka_config).items()}
        except (ValueError, AttributeError) as exc:
            print(f"odl-serve: --kafka_config is not a JSON object: {exc}", file=sys.stderr)
            return 2
    from odl.http.auth import AuthConfigError, resolve_auth_token

    try:  # before the heavy imports: a bad token file is reported at once
        token = resolve_auth_token(args.auth_token_file or None)
    except AuthConfigError as exc:
        print(f"odl-serve: {exc}", file=sys.stderr)
        return 2
    from odl.config.config_error import ConfigError
    from odl.models.subnormal_floats import flush_subnormal_floats
    from odl.train.torch_runtime import configure_torch_threads
    from serving_plugin.export_reader import ExportLoadError
    from serving_plugin.predict_limits import PredictLimits
    from serving_plugin.serving_service import ServingService
    from serving_plugin.serving_tier import DiskTierSettings

    try:
        limits = PredictLimits(max_body_bytes=args.max_body_bytes,
                               max_inflight_requests=args.max_inflight_requests,
                               max_inflight_bytes=args.max_inflight_bytes,
                               body_timeout_s=args.body_timeout_s)
        disk_tier = (DiskTierSettings(args.disk_tier_dir, args.ram_rows, args.max_disk_rows)
                     if args.disk_tier_dir else None)
    except ValueError as exc:
        print(f"odl-serve: {exc}", file=sys.stderr)
        return 2
    flush_subnormal_floats()  # before torch's first computation starts its workers
    configure_torch_threads(args.torch_threads)
    try:
        service = ServingService(args.export_dir, replay=not args.no_replay, kafka_extra=extra,
                                 server_override=args.kafka_server, verify=not args.no_verify,
                                 fetch_interval_ms=max(0, args.fetch_interval_ms),
                                 limits=limits, delta_dir=args.delta_dir,
                                 delta_after_day=args.delta_after_day,
                                 delta_poll_secs=max(0.1, args.delta_poll_secs),
                                 disk_tier=disk_tier)
    except (ExportLoadError, ConfigError) as exc:
        print(f"odl-serve: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        logger.info("%s received: stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    port = service.start(args.host, args.port, auth_token=token)
    logger.info("odl-serve ready on http://%s:%d (export %s, version %d)", args.host, port,
                service.model.path, service.model.state.version)
    while not stop.wait(1.0):
        pass
    service.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
