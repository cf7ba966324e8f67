"""``odl-train --nproc N`` (``odl.cli.local_ranks``): the ranks get the launcher's command line
without its own flags; bad values are refused before anything starts. The launch itself is
run by ``tests/test_dynamic_partitions.py`` (two ranks training offline files)."""

from __future__ import annotations

import pytest

from odl.cli import train_cli
from odl.cli.local_ranks import rank_arguments


def test_ranks_get_the_command_line_without_the_launchers_flags():
    argv = ["--pipeline_config_path", "p.config", "--nproc", "4", "--online",
            "--max_restarts=2", "--nproc=4", "--max_restarts", "0", "--device", "cpu"]
    assert rank_arguments(argv) == ["--pipeline_config_path", "p.config", "--online",
                                    "--device", "cpu"]


@pytest.mark.parametrize("flags", [["--nproc", "0"], ["--nproc", "2", "--max_restarts", "-1"]])
def test_bad_launch_values_are_refused_with_exit_code_2(flags, capsys):
    with pytest.raises(SystemExit) as exc:
        train_cli.main(["--pipeline_config_path", "unused.config", *flags])
    assert exc.value.code == 2
    assert "--nproc must be >= 1" in capsys.readouterr().err


def test_more_ranks_than_gpus_are_refused_naming_the_gpu_count(monkeypatch):
    """TorchRec places local rank r's table shards on cuda:r, so a rank without a GPU of its
    own must stop at start with the rule, not fail deep inside sharding. Checked here with a
    host that reports one GPU (CI has none)."""
    import torch

    from odl.config.config_error import ConfigError
    from odl.train.torch_runtime import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert resolve_device("cuda") == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ConfigError) as e:
        resolve_device("cuda")
    assert "1 GPU(s)" in str(e.value) and "one rank per GPU" in str(e.value)
    with pytest.raises(ConfigError):
        resolve_device("cuda:3")  # an explicit GPU the host does not have
    assert resolve_device("cpu") == torch.device("cpu")
