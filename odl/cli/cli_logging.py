"""Logging set-up shared by the odl command-line tools."""

from __future__ import annotations

import logging
import os
import warnings


def setup_logging(level: str = "INFO") -> None:
    """Configures root logging for a CLI process (one line per record, to stderr).

    Args:
        level: logging level name.
    """
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # Library chatter that says nothing to an odl user.
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    for name in ("torch.fx._symbolic_trace", "torchrec", "fbgemm_gpu", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)
