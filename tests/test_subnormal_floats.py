"""Dense weights that decay into the subnormal range train and serve at full speed.

A ReLU unit that stops firing gets only the L2 term's gradient, so Adam shrinks its weights
geometrically until they are subnormal; x86 CPUs then compute with them ~100x slower unless
subnormals are flushed to zero in every thread (``odl.models.subnormal_floats``). These
tests put subnormal weights into a trained model's first DNN layer and compare a train step
and a prediction against the same model with those weights zero, measured alternately in
one process: without flushing the subnormal step is several times slower.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from odl.checkpoint.checkpoint_manager import CheckpointManager
from odl.config.config_redaction import config_to_text
from odl.config.pipeline_config import parse_pipeline_config_text
from odl.datagen.datagen_config import deepfm_config_text
from odl.export.exporter import export_checkpoint
from odl.features.feature_builder import FeatureBuilder
from odl.train.train_module import TrainModule
from serving_plugin.export_reader import read_export
from serving_plugin.serving_model import ServingModel
from tests.harness import synthetic_records


def _cpu_can_flush() -> bool:
    """Whether this CPU has denormals-are-zero (x86 with SSE3); leaves flushing on."""
    return bool(torch.set_flush_denormal(True))


pytestmark = pytest.mark.skipif(not _cpu_can_flush(),
                                reason="this CPU cannot flush subnormal floats")

# A dead unit's incoming weights: whole rows of the first DNN layer, as the soak found them
# (21 of 256 rows after 2,000 steps of samples/deepfm_online.config).
_DEAD_ROWS = 64
_ROUNDS = 5
# Flushed, both runs do the same work: the median ratio stays near 1. Unflushed it is 5x+.
_MAX_RATIO = 2.0


def _subnormal_bits(shape: tuple[int, ...]) -> torch.Tensor:
    """Subnormal float32 values made from bit patterns (no float conversion flushes them)."""
    return torch.randint(1, 1 << 22, shape, dtype=torch.int32).view(torch.float32)


def _first_linear(params: dict[str, torch.Tensor]) -> torch.Tensor:
    name = next(n for n, p in params.items() if p.dim() == 2 and "dnn" in n)
    return params[name]


def _slowdown(weight: torch.Tensor, run) -> float:
    """Median over rounds of run()'s time with the first rows of ``weight`` subnormal / zero."""
    rows = slice(0, _DEAD_ROWS)
    shape = tuple(weight[rows].shape)

    @torch.no_grad()
    def make_subnormal() -> None:
        weight[rows] = _subnormal_bits(shape)
        assert bool((weight[rows].view(torch.int32) != 0).all())  # stored, not flushed

    @torch.no_grad()
    def make_zero() -> None:
        weight[rows] = 0.0

    ratios = []
    for _ in range(_ROUNDS):
        timed = []
        for prepare in (make_subnormal, make_zero):
            prepare()
            start = time.perf_counter()
            run()
            timed.append(time.perf_counter() - start)
        ratios.append(timed[0] / timed[1])
    return statistics.median(ratios)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A DeepFM of the benchmark's width (DNN 256-128-64 over 26 dim-16 features)."""
    root = tmp_path_factory.mktemp("subnormal")
    config = parse_pipeline_config_text(deepfm_config_text(
        str(root / "model_dir"), batch_size=1024, dim=16, buckets=2000,
        hidden_units=(256, 128, 64)))
    fb = FeatureBuilder(config)
    module = TrainModule(config, fb, device="cpu")
    records = synthetic_records(1024 * 3, seed=7)
    batches = [fb.build(records[i:i + 1024]).batch for i in range(0, len(records), 1024)]
    for batch in batches[:2]:
        module.train_step(batch)
    return config, fb, module, batches[2], root


def test_a_model_with_subnormal_weights_trains_at_full_speed(trained):
    _config, _fb, module, batch, _root = trained
    weight = _first_linear(module.dense_parameters())
    ratio = _slowdown(weight, lambda: module.train_step(batch))
    assert ratio < _MAX_RATIO, f"a step with subnormal weights took {ratio:.1f}x as long"


def test_a_model_with_subnormal_weights_serves_at_full_speed(trained):
    config, _fb, module, batch, root = trained
    ckpt = CheckpointManager(str(root / "model_dir")).save(
        module.global_step, module.state_dict_for_checkpoint(), {0: 0},
        {"source": "kafka", "topic": "samples"}, config_to_text(config), generation="gen0")
    export = export_checkpoint(config, ckpt, str(root / "exports")).path
    model = ServingModel(read_export(export))
    weight = _first_linear(dict(model.dense_module.named_parameters()))
    ratio = _slowdown(weight, lambda: model.predict_batch(batch))
    assert ratio < _MAX_RATIO, f"a prediction with subnormal weights took {ratio:.1f}x as long"


def test_flushing_reaches_torch_workers_started_before_it():
    """A library caller that computed with torch first still gets flushing in every worker."""
    script = textwrap.dedent("""
        import torch
        torch.set_num_threads(2)
        (torch.ones(1 << 20) * 2).sum()  # starts the intra-op workers
        from odl.models.subnormal_floats import flush_subnormal_floats, subnormals_flushed
        torch.set_flush_denormal(True)  # this thread only: the workers keep theirs
        print(subnormals_flushed(), flush_subnormal_floats(), subnormals_flushed())
    """)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=120, check=True).stdout.split()
    assert out == ["False", "True", "True"]
