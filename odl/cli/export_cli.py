r"""``odl-export``: writes a checkpoint as a self-contained serving base.

Examples::

    odl-export --pipeline_config_path p.config --checkpoint_path model_dir/model.ckpt-1000 \
        --export_dir exports
    odl-export --pipeline_config_path p.config --checkpoint_path model_dir \
        --export_dir exports --oss_path /data/embeddings --asset_files fg.json
    export OSS_ACCESS_KEY_ID=... OSS_ACCESS_KEY_SECRET=...
    export OSS_ENDPOINT=https://oss-cn-hangzhou.aliyuncs.com
    odl-export --pipeline_config_path oss://bkt/p.config --checkpoint_path oss://bkt/model_dir \
        --export_dir oss://bkt/exports --oss_path oss://bkt/embeddings

Writes ``<export_dir>/<unix-seconds>/`` (layout: ``odl.export.exporter``) and prints its
path on stdout. Exit codes: 0 written; 2 bad command line, config or destination (one line
naming the problem); 1 anything else (e.g. no usable checkpoint).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional

from odl.cli.cli_logging import setup_logging
from odl.cli.oss_arguments import add_oss_arguments, apply_oss_arguments

logger = logging.getLogger("odl.export")


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser."""
    p = argparse.ArgumentParser(
        prog="odl-export", description="Export a checkpoint as a serving base directory.")
    p.add_argument("--pipeline_config_path", required=True, help="pipeline config (text proto)")
    p.add_argument("--checkpoint_path", default="",
                   help="model.ckpt-N directory or a model_dir (its newest checkpoint); "
                        "default: the config's model_dir")
    p.add_argument("--export_dir", required=True,
                   help="parent directory of the exports (local or oss://bucket/prefix)")
    p.add_argument("--oss_path", default="",
                   help="write the embedding shards here instead of inside the export "
                        "(local path or oss://bucket/prefix)")
    p.add_argument("--asset_files", default="",
                   help="comma separated files copied to assets/ (local or oss://)")
    add_oss_arguments(p)
    p.add_argument("--delta_server", default="",
                   help="delta topic servers for kafka.txt (default: from the checkpoint's "
                        "positions.json, else train_config.incr_save_config.kafka)")
    p.add_argument("--delta_topic", default="",
                   help="delta topic for kafka.txt (default: as --delta_server)")
    p.add_argument("--edit_config_json", help='JSON edits, e.g. {"model_dir": "/x"}')
    p.add_argument("--log_level", default="INFO")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of ``odl-export``."""
    args = build_parser().parse_args(argv)
    apply_oss_arguments(args)
    setup_logging(args.log_level)
    from odl.checkpoint.checkpoint_manager import CheckpointError
    from odl.config.config_error import ConfigError
    from odl.config.config_validation import validate_data_and_features
    from odl.config.pipeline_config import load_pipeline_config
    from odl.export.exporter import ExportError, export_checkpoint
    from odl.models.model_registry import validate_model
    from odl.storage.oss_credentials import OssCredentialsError
    from odl.storage.oss_store import StorageError

    try:
        config = load_pipeline_config(args.pipeline_config_path, args.edit_config_json)
        # what the export builds: the feature plan and the model (not the inputs)
        validate_data_and_features(config)
        validate_model(config)
    except ConfigError as exc:
        print(f"odl-export: {exc}", file=sys.stderr)
        return 2
    ckpt = args.checkpoint_path or config.model_dir
    if not ckpt:
        print("odl-export: no --checkpoint_path and the config has no model_dir", file=sys.stderr)
        return 2
    assets = [a for a in args.asset_files.split(",") if a.strip()]
    try:
        result = export_checkpoint(
            config, ckpt, args.export_dir, oss_path=args.oss_path, asset_files=assets,
            delta_server=args.delta_server, delta_topic=args.delta_topic)
    except (ConfigError, ExportError) as exc:
        print(f"odl-export: {exc}", file=sys.stderr)
        return 2
    except OssCredentialsError as exc:
        print(f"odl-export: {exc}", file=sys.stderr)
        return 2
    except (CheckpointError, StorageError) as exc:
        print(f"odl-export: {exc}", file=sys.stderr)
        return 1
    print(result.path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
