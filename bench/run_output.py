"""What every benchmark does with its results and its scratch space.

``--json PATH`` writes the figures (the dict the benchmark printed) as indented JSON and,
for a benchmark that draws one, its plot beside it as ``PATH`` with ``.png`` for ``.json``
(``bench.bench_plots``); the work directory (broker data, model dirs, checkpoints: gigabytes
per run) is removed at the end unless ``--keep`` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from collections.abc import Callable
from typing import Optional


def add_output_args(ap: argparse.ArgumentParser) -> None:
    """Adds ``--json`` and ``--keep`` to a benchmark's argument parser."""
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--keep", action="store_true",
                    help="keep the work directory (broker data, model dirs, logs)")


def finish_run(args: argparse.Namespace, result: dict, work_dir: str,
               plot: Optional[Callable[[str], None]] = None) -> None:
    """Writes ``result`` to ``--json`` (if given) and removes ``work_dir`` unless ``--keep``.

    Args:
        args: the parsed arguments (``--json``, ``--keep``).
        result: the figures.
        work_dir: the benchmark's scratch directory.
        plot: draws the benchmark's plot into the path it is given (with ``--json`` only).
    """
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        if plot is not None:
            png = os.path.splitext(args.json)[0] + ".png"
            plot(png)
            print(f"plot: {png}")
    if not args.keep:
        shutil.rmtree(work_dir, ignore_errors=True)
