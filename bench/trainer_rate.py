"""The in-memory train step rate an input bench compares its input rate with."""

from __future__ import annotations

import time

from odl.features.feature_builder import FeatureBuilder
from odl.protos import pipeline_pb2
from odl.train.train_module import TrainModule


def train_samples_per_sec(config: pipeline_pb2.EasyRecConfig, builder: FeatureBuilder,
                          values: list[bytes], batch_size: int, batches: int = 60,
                          warmup: int = 5) -> float:
    """``TrainModule.train_step`` samples/s on CPU over the first ``batches`` batches of
    ``values`` (built before the clock starts; the first ``warmup`` steps not timed)."""
    module = TrainModule(config, builder, device="cpu")
    built = [builder.build(values[i:i + batch_size]).batch
             for i in range(0, min(len(values), batches * batch_size), batch_size)]
    for b in built[:warmup]:
        module.train_step(b)
    t0 = time.perf_counter()
    n = 0
    for b in built[warmup:]:
        module.train_step(b)
        n += b.size
    return n / (time.perf_counter() - t0)
