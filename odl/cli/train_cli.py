r"""``odl-train``: the online (Kafka) and offline (files) trainer.

Examples::

    odl-train --pipeline_config_path samples/deepfm_online.config --online
    odl-train --pipeline_config_path samples/deepfm_offline.config \\
        --train_input_path 'data/*.csv' --model_dir .odl/offline
    odl-train --pipeline_config_path p.config --online \\
        --edit_config_json '{"kafka_train_input.server": "broker:9092"}'
    odl-train --pipeline_config_path p.config --online --validate_only
    odl-train --pipeline_config_path p.config --online --max_memory_fraction 0.9
    odl-train --pipeline_config_path p.config --online --status_host 0.0.0.0 \
        --auth_token_file /etc/odl/token
    odl-train --pipeline_config_path p.config --online --nproc 4

Before anything is built, a start (and ``--validate_only``) checks the config on its own
(what ``odl.models.model_registry.check_pipeline_config`` runs: the config layer's checks,
before torch is imported, then the model class's) and against this machine
(``odl.train.startup_checks``: device and table optimizer, writable ``model_dir``,
``fine_tune_checkpoint``, librdkafka settings, estimated memory).

Exit codes: 0 clean stop (stop signal, SIGTERM/SIGINT, dead_line, num_steps, end of offline
input); 2 bad command line or config (one line naming the field), or a broker that refuses the
delta topic's transactional producer; 3 fenced: a newer trainer took over the delta topic
(docs/publishing.md, topic ownership); 130 SIGINT/SIGTERM during start-up, before the trainer
was built (nothing trained or written); 1 anything else (a failed input or publisher: a
restart continues from the last checkpoint).
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import sys
import threading
from typing import Optional

from odl.cli.cli_logging import setup_logging
from odl.cli.oss_arguments import add_oss_arguments, apply_oss_arguments

logger = logging.getLogger("odl.train")


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser."""
    p = argparse.ArgumentParser(
        prog="odl-train", description="Train a CTR model online from Kafka or offline from files."
    )
    p.add_argument("--pipeline_config_path", required=True, help="pipeline config (text proto)")
    p.add_argument("--model_dir", help="overrides model_dir of the config")
    p.add_argument("--online", action="store_true", help="train from kafka_train_input")
    p.add_argument(
        "--continue_train",
        action="store_true",
        help="restore the newest checkpoint of model_dir (the default whenever one exists)",
    )
    p.add_argument("--fine_tune_checkpoint", help="warm-start parameters from this checkpoint")
    p.add_argument("--train_input_path", help="offline input glob (overrides the config)")
    p.add_argument("--edit_config_json", help='JSON edits, e.g. {"train_config.num_steps": 10}')
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--status_port", type=int, default=0, help="0 = any free port, -1 = off")
    p.add_argument("--status_host", default="127.0.0.1",
                   help="bind address of the status API; another than loopback should come "
                        "with --auth_token_file")
    p.add_argument("--dashboard_interval_s", type=float, default=2.0,
                   help="seconds between two points of the status API's dashboard history "
                        "(GET / and /history; kept for 24 h, downsampled); 0 = none")
    p.add_argument("--auth_token_file", default="",
                   help="file holding a bearer token the status API requires on every "
                        "endpoint but /healthz (default: env ODL_AUTH_TOKEN; none = open)")
    p.add_argument("--validate_only", action="store_true",
                   help="run every start-up check (config, device, paths, Kafka settings, "
                        "memory), print 'config OK', exit 0 (2 if invalid)")
    p.add_argument("--max_memory_fraction", type=float, default=None,
                   help="share of the available memory (host; device on CUDA) the estimated "
                        "need may reach (default: env ODL_MAX_MEMORY_FRACTION, else 0.8; "
                        "0 = no memory check)")
    p.add_argument("--sample_ledger",
                   help="append '<generation>\\t<step>\\t<sample_id>' per trained sample")
    p.add_argument("--take_over_delta_topic", action="store_true",
                   help="publish to incr_save_config's delta topic even when its newest "
                        "version is another model's (another model_dir); without it such a "
                        "start exits 2 naming the owner (docs/operations.md)")
    p.add_argument(
        "--torch_threads", type=int, default=0,
        help="torch intra-op threads; 0 = half of the CPUs (leaves room for input and I/O)",
    )
    p.add_argument("--nproc", type=int, default=1,
                   help="train one model with this many processes of this host: runs "
                        "torchrun --standalone --nproc_per_node N on the other arguments "
                        "(docs/training.md#several-processes); 1 = this process")
    p.add_argument("--max_restarts", type=int, default=3,
                   help="with --nproc: torchrun's restarts of all ranks after one died")
    add_oss_arguments(p)
    p.add_argument("--log_level", default="INFO")
    return p


class _StartupInterrupted(BaseException):
    """SIGINT / SIGTERM before the trainer could take signals itself.

    A ``BaseException``, as ``KeyboardInterrupt``: an ``except Exception`` in an imported
    library does not swallow it.
    """


_startup_signals: list[str] = []  # every start-up signal, even one whose exception was lost


def _interrupt_startup(signum: int, _frame: object) -> None:
    name = signal.Signals(signum).name
    _startup_signals.append(name)
    raise _StartupInterrupted(name)


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of ``odl-train``.

    From the start, SIGINT and SIGTERM stop start-up with one line on stderr and exit code
    130 (nothing is trained or written); once the trainer is built they ask it for a clean
    stop (finish the step, checkpoint, exit 0). A rank of ``torchrun`` (``WORLD_SIZE`` > 1)
    ends its process with its exit code once everything is closed
    (``odl.train.distributed.end_rank_process``); an unexpected error there prints its
    traceback and exits 1.
    """
    ranked = int(os.environ.get("WORLD_SIZE", "1")) > 1
    previous: dict = {}
    try:
        # installed inside the try: a signal right after its handler is in (while the other
        # is installed) is a start-up interrupt like any later one
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.getsignal(sig)
                signal.signal(sig, _interrupt_startup)
        exit_code = _main(argv)
    except _StartupInterrupted as exc:
        print(f"odl-train: {exc} during start-up: stopped before training", file=sys.stderr)
        exit_code = 130
    except Exception:
        if not ranked:
            raise
        logger.exception("odl-train failed")
        exit_code = 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if ranked:
        from odl.train.distributed import end_rank_process

        end_rank_process(exit_code)
    return exit_code


def _main(argv: Optional[list[str]]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.dashboard_interval_s < 0:
        parser.error("--dashboard_interval_s must be >= 0")  # exit 2
    if args.nproc < 1 or args.max_restarts < 0:
        parser.error("--nproc must be >= 1 and --max_restarts >= 0")  # exit 2
    # the launcher of --nproc ranks checks everything first, then starts them
    launching = args.nproc > 1 and "WORLD_SIZE" not in os.environ
    apply_oss_arguments(args)
    setup_logging(args.log_level)
    # Imports after argument parsing so --help is instant; the config layer's checks run
    # before torch is imported, so a config error exits at once.
    from odl.config.config_error import ConfigError
    from odl.config.config_validation import validate_pipeline_config
    from odl.config.pipeline_config import load_pipeline_config
    from odl.http.auth import AuthConfigError

    try:
        config = load_pipeline_config(
            args.pipeline_config_path, args.edit_config_json, model_dir=args.model_dir
        )
        if args.fine_tune_checkpoint:
            config.train_config.fine_tune_checkpoint = args.fine_tune_checkpoint
        if args.train_input_path:
            config.train_input_path = args.train_input_path
        validate_pipeline_config(config, online=args.online)
    except ConfigError as exc:
        print(f"odl-train: {exc}", file=sys.stderr)
        return 2
    from odl.features.feature_builder import FeatureBuilder
    from odl.http.auth import resolve_auth_token
    from odl.models.model_registry import validate_model
    from odl.train.startup_checks import check_start

    try:
        validate_model(config)  # the model class's own checks (check_pipeline_config's rest)
        FeatureBuilder(config)  # reads the vocabularies as the trainer does at start
        token = resolve_auth_token(args.auth_token_file or None)
        # the checks against this machine, before anything is allocated
        start = check_start(config, online=args.online, device=args.device,
                            max_memory_fraction=args.max_memory_fraction,
                            sample_ledger=args.sample_ledger,
                            create_dirs=not args.validate_only,
                            ranks=args.nproc if launching else None)
    except (ConfigError, AuthConfigError) as exc:
        print(f"odl-train: {exc}", file=sys.stderr)
        return 2
    if args.validate_only:
        for note in start.notes:
            print(f"note: {note}")
        print("config OK")
        return 0
    if launching:
        from odl.cli.local_ranks import run_local_ranks

        return run_local_ranks(args.nproc, args.max_restarts,
                               sys.argv[1:] if argv is None else argv)

    from odl.export.exporter import export_checkpoint
    from odl.models.subnormal_floats import flush_subnormal_floats
    from odl.train.torch_runtime import configure_torch_threads
    from odl.train.trainer import Trainer, TrainerOptions

    flush_subnormal_floats()  # before torch's first computation starts its workers
    configure_torch_threads(args.torch_threads)
    options = TrainerOptions(
        online=args.online,
        device=args.device,
        status_port=args.status_port,
        status_host=args.status_host,
        sample_ledger=args.sample_ledger,
        continue_train=True,
        auth_token=token,
        dashboard_interval_s=args.dashboard_interval_s,
        export_base=functools.partial(export_checkpoint, warn_without_topic=False),
        take_over_delta_topic=args.take_over_delta_topic,
    )
    try:
        trainer = Trainer(config, options)
    except ConfigError as exc:
        print(f"odl-train: {exc}", file=sys.stderr)
        return 2

    def on_signal(signum: int, _frame: object) -> None:
        trainer.request_stop(f"{signal.Signals(signum).name} received")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if _startup_signals:  # its exception was raised where something swallowed it (a __del__;
        # the trainer has started nothing yet)
        raise _StartupInterrupted(_startup_signals[0])
    try:
        return trainer.run()
    except ConfigError as exc:  # a config problem only found while starting
        print(f"odl-train: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
