"""What every benchmark does with its results and its scratch space.

``--json PATH`` writes the figures (the dict the benchmark printed) as indented JSON;
the work directory (broker data, model dirs, checkpoints: gigabytes per run) is removed at
the end unless ``--keep`` is given.
"""

from __future__ import annotations

import argparse
import json
import shutil


def add_output_args(ap: argparse.ArgumentParser) -> None:
    """Adds ``--json`` and ``--keep`` to a benchmark's argument parser."""
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--keep", action="store_true",
                    help="keep the work directory (broker data, model dirs, logs)")


def finish_run(args: argparse.Namespace, result: dict, work_dir: str) -> None:
    """Writes ``result`` to ``--json`` (if given) and removes ``work_dir`` unless ``--keep``."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if not args.keep:
        shutil.rmtree(work_dir, ignore_errors=True)
