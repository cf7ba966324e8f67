"""Logging set-up shared by the odl command-line tools."""

from __future__ import annotations

import logging

from odl.train.torch_runtime import quiet_library_noise


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
    # and future warnings, e.g. ShardedTensor's, fbgemm's kernel lines); --log_level DEBUG
    # shows all of it
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        quiet_library_noise()
        for handler in logging.getLogger().handlers:
            handler.addFilter(_RootLibraryNoise())
