"""What the odl commands log: their own lines, not a library's chatter through the root logger."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent("""
    import logging, sys, warnings
    from odl.cli.cli_logging import setup_logging
    setup_logging(sys.argv[1])
    logging.info("[TBE=1] SplitTableBatchedEmbeddingBagsCodegen Arguments: {...}")
    warnings.warn("Please use DTensor instead and we are deprecating ShardedTensor.",
                  FutureWarning)
    logging.getLogger("torch.fx._symbolic_trace").warning("is_fx_tracing will return true")
    logging.warning("a library's warning")
    logging.getLogger("odl.train.trainer").info("step 50 samples 51200")
    logging.getLogger("odl.train.trainer").debug("a debug line")
""")


def _stderr(level: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    return subprocess.run([sys.executable, "-c", _SCRIPT, level], capture_output=True,
                          text=True, env=env, timeout=60, check=True).stderr


def test_info_level_keeps_odl_lines_and_drops_a_library_s_root_info_lines():
    err = _stderr("INFO")
    assert "step 50 samples 51200" in err
    assert "a library's warning" in err
    assert "TBE=" not in err
    assert "a debug line" not in err
    assert "ShardedTensor" not in err and "is_fx_tracing" not in err  # torch's, TorchRec's


def test_debug_level_shows_everything():
    err = _stderr("DEBUG")
    assert "TBE=" in err and "a debug line" in err and "step 50 samples 51200" in err
    assert "ShardedTensor" in err and "is_fx_tracing" in err
