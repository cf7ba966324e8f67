"""Logging set-up shared by the odl command-line tools."""

from __future__ import annotations

import logging
import os
import warnings


class _RootLibraryNoise(logging.Filter):
    """Drops what libraries log through the root logger at INFO and below.

    fbgemm logs every embedding kernel's full argument list (``[TBE=...] ...``, several KB a
    line) with ``logging.info``, i.e. as ``root``, which a logger level cannot silence.
    odl's own records always come from named module loggers.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return record.name != "root" or record.levelno > logging.INFO


def setup_logging(level: str = "INFO") -> None:
    """Configures root logging for a CLI process (one line per record, to stderr).

    Args:
        level: logging level name.
    """
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # Library chatter that says nothing to an odl user (torch's and torchrec's deprecation
    # and future warnings, e.g. ShardedTensor's); --log_level DEBUG shows them
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        for category in (UserWarning, DeprecationWarning, FutureWarning):
            warnings.filterwarnings("ignore", category=category)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    for name in ("torch.fx._symbolic_trace", "torchrec", "fbgemm_gpu", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:  # --log_level DEBUG shows all
        for handler in logging.getLogger().handlers:
            handler.addFilter(_RootLibraryNoise())
