"""Test-only harness: pipeline configs, in-process trainers, trained checkpoints.

What benchmarks need as well (records on topics, HTTP, trainer processes, audits) lives in
``odl.harness``.
"""

from __future__ import annotations

import json
import os
import random
import re
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import psutil
import torch

from odl.checkpoint.checkpoint_manager import CheckpointManager
from odl.config.config_redaction import config_to_text
from odl.config.pipeline_config import load_pipeline_config, parse_pipeline_config_text
from odl.datagen.datagen_config import deepfm_config_text
from odl.features.feature_builder import FeatureBuilder
from odl.harness.model_configs import as_model_config_text
from odl.harness.topic_records import make_records
from odl.models.model_registry import check_pipeline_config
from odl.protos import pipeline_pb2
from odl.train.train_module import TrainModule
from odl.train.trainer import Trainer, TrainerOptions

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def wait_for_value(condition, what: str, timeout: float = 20.0, interval: float = 0.1):
    """Polls ``condition`` until it returns something truthy and returns that.

    Raises:
        AssertionError: ``timeout`` seconds passed first (naming ``what``).
    """
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(interval)


def load_config_text(text: str) -> pipeline_pb2.EasyRecConfig:
    """Loads ``text`` as odl-train loads a config file (TorchEasyRec's forms normalized) and
    validates it for online training."""
    with tempfile.NamedTemporaryFile("w", suffix=".config", delete=False) as f:
        f.write(text)
    try:
        config = load_pipeline_config(f.name)
    finally:
        os.unlink(f.name)
    check_pipeline_config(config, online=True)
    return config


def assert_edit_refused(text: str, edit: tuple[str, str], field: str, words: str) -> None:
    """``text`` with ``edit`` applied (it must apply) is refused naming ``field`` and ``words``."""
    from odl.config.config_error import ConfigError

    assert edit[0] in text, edit[0]
    try:
        load_config_text(text.replace(*edit))
    except ConfigError as e:
        assert e.field == field and words in str(e), e
        return
    raise AssertionError(f"not refused: {edit}")


def write_config(tmp_path, bootstrap: str, topic: str, name: str = "pipeline.config", **kw) -> str:
    """Writes the test-size DeepFM pipeline config reading ``topic``; returns its path.

    ``model_dir`` is ``tmp_path / "model_dir"``; ``kw`` goes to ``deepfm_config_text``.
    In-batch learning is off unless ``extra_train`` writes it: the tests on this config are
    of the trainer's loop (positions, checkpoints, publishing, ranks), which the batched step
    keeps cheap; the stream's decision (the default) has its own tests
    (``test_in_batch_choice.py``).
    """
    extra = kw.get("extra_train", "")
    if "in_batch_learning" not in extra:
        kw["extra_train"] = f"{extra} in_batch_learning: false".strip()
    model_dir = str(tmp_path / "model_dir")
    path = str(tmp_path / name)
    with open(path, "w") as f:
        f.write(deepfm_config_text(model_dir, server=bootstrap, topic=topic, **kw))
    return path


def make_half_dynamic(cfg: str, ev_params: str) -> list[str]:
    """Gives every other id feature of the config file ``cfg`` the ``ev_params`` message
    (its tables become dynamic, the others stay fixed); returns their names."""
    text = open(cfg).read()
    made = []
    for i, name in enumerate(re.findall(r'input_names: "(\w+)" feature_type: IdFeature', text)):
        if i % 2:
            text, n = re.subn(rf'(input_names: "{name}" feature_type: IdFeature [^}}]*)}}',
                              rf"\1{ev_params} }}", text, count=1)
            assert n == 1, name
            made.append(name)
    open(cfg, "w").write(text)
    return made


def run_in_process(
    config_path: str,
    ends: dict[int, int],
    ledger: Optional[str] = None,
    edits: Optional[dict] = None,
    timeout: float = 120,
    status_port: int = -1,
    device: str = "cpu",
) -> Trainer:
    """Runs a Trainer in this process until it has trained up to ``ends``; returns it stopped."""
    config = load_pipeline_config(config_path, json.dumps(edits) if edits else None)
    check_pipeline_config(config, online=True)
    trainer = Trainer(
        config,
        TrainerOptions(
            online=True, device=device, status_port=status_port, sample_ledger=ledger
        ),
    )
    done = threading.Event()

    def watch():
        deadline = time.time() + timeout
        while time.time() < deadline and not done.is_set():
            pos = dict(trainer.positions)
            caught_up = pos and all(pos.get(p, 0) >= e for p, e in ends.items())
            if trainer.state == "training" and caught_up:
                trainer.request_stop("test: caught up")
                return
            time.sleep(0.05)
        trainer.request_stop("test: timeout")

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        assert trainer.run() == 0
    finally:
        done.set()
    assert trainer.stop_reason == "test: caught up", trainer.stop_reason
    return trainer


def run_in_thread(trainer: Trainer) -> tuple[threading.Thread, dict]:
    """Runs ``trainer.run()`` in a daemon thread; the dict gets ``rc`` or ``error``."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["rc"] = trainer.run()
        except BaseException as exc:  # noqa: BLE001 (the test inspects it)
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def odl_helper_processes() -> list[psutil.Process]:
    """Live descendants of this process that are odl helpers (input process, build workers)."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "odl.inputs.kafka_input_child" in cmd or "odl.inputs.feature_build_worker" in cmd:
            found.append(child)
    return found


# Every feature kind and model option serving must reproduce: multi-valued ids,
# integer ids in a shared-name table, a combo, bucketized raw, dense raw in the wide group
# (wide linear term) and a deep subset of dense columns, wide_output_dim 3 (stored as 4),
# batch norm, dropout and a final DNN.
EXOTIC_CONFIG = """
model_dir: "{model_dir}"
data_config {{
  batch_size: 64
  input_fields {{ input_name: "label" input_type: INT32 }}
  input_fields {{ input_name: "x" input_type: FLOAT }}
  input_fields {{ input_name: "y" input_type: FLOAT default_val: "0.5" }}
  input_fields {{ input_name: "u" }}
  input_fields {{ input_name: "tags" }}
  input_fields {{ input_name: "n" input_type: INT64 }}
  label_fields: "label"
  separator: ";"
}}
feature_config {{
  features {{ input_names: "x" feature_type: RawFeature }}
  features {{ input_names: "y" feature_type: RawFeature }}
  features {{ feature_name: "xb" input_names: "x" feature_type: RawFeature
              boundaries: [-1, 0, 1] embedding_dim: 8 }}
  features {{ input_names: "u" hash_bucket_size: 300 embedding_dim: 8 }}
  features {{ input_names: "tags" hash_bucket_size: 200 embedding_dim: 8 }}
  features {{ input_names: "n" num_buckets: 50 embedding_dim: 8 embedding_name: "shared" }}
  features {{ feature_name: "uc" input_names: ["u", "n"] feature_type: ComboFeature
              hash_bucket_size: 100 embedding_dim: 8 }}
}}
model_config {{
  model_class: "DeepFM"
  feature_groups {{ group_name: "wide" feature_names: ["u", "tags", "xb", "y"] wide_deep: WIDE }}
  feature_groups {{ group_name: "deep" feature_names: ["u", "tags", "n", "uc", "xb", "x"]
                   wide_deep: DEEP }}
  deepfm {{
    dnn {{ hidden_units: [16, 8] use_bn: true dropout_ratio: [0.1, 0.0] }}
    final_dnn {{ hidden_units: [8] }}
    wide_output_dim: 3
  }}
}}
train_config {{
  sparse_optimizer {{ adagrad_optimizer {{ lr: 0.1 }} }}
  dense_optimizer {{ adam_optimizer {{ lr: 0.01 }} }}
  seed: 3
}}
"""


def exotic_records(n: int, seed: int = 0) -> list[bytes]:
    """Random CSV records for ``EXOTIC_CONFIG`` (empty tags, empty y, negative ints)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        x = f"{rng.gauss(0, 1.5):.4f}"
        y = "" if rng.random() < 0.2 else f"{rng.random():.3f}"
        u = f"u{rng.randrange(400)}"
        tags = "|".join(f"t{rng.randrange(60)}" for _ in range(rng.randrange(0, 4)))
        num = str(rng.randrange(-30, 90))
        label = str(int(rng.random() < 0.3))
        out.append(";".join([label, x, y, u, tags, num]).encode())
    return out


def synthetic_records(n: int, seed: int = 0, fmt: str = "csv") -> list[bytes]:
    """Records of the datagen schema."""
    return make_records(n, seed=seed, fmt=fmt)[1]


@dataclass
class TrainedCheckpoint:
    """A checkpoint written from a ``TrainModule`` trained on a few batches.

    Attributes:
        config: the pipeline config.
        feature_builder: its feature builder.
        module: the trained module (its state equals the checkpoint's).
        model_dir: the model directory.
        path: the checkpoint directory.
        records: function ``(n, seed) -> records`` of the config's schema.
    """

    config: pipeline_pb2.EasyRecConfig
    feature_builder: FeatureBuilder
    module: TrainModule
    model_dir: str
    path: str
    records: object


def train_checkpoint(
    root: str,
    kind: str = "synthetic",
    steps: int = 8,
    delta_offset: int | None = None,
    extra_source: dict | None = None,
) -> TrainedCheckpoint:
    """Trains a module a few steps and writes one checkpoint.

    Args:
        root: directory for model_dir.
        kind: ``"synthetic"`` (datagen schema, 8 id features) or ``"exotic"``.
        steps: training steps of 64 records.
        delta_offset: recorded as positions.json ``delta_topic_offset`` when given.
        extra_source: more keys for positions.json.

    Returns:
        The checkpoint and the module.
    """
    model_dir = os.path.join(root, "model_dir")
    if kind == "synthetic":
        text = deepfm_config_text(model_dir, buckets=500, dim=8,
                                  sparse_fields=tuple(f"C{i}" for i in range(1, 9)),
                                  kafka_extra='kafka_config { key: "sasl.password" '
                                              'value: "hunter2" }')
        records = synthetic_records
    else:
        text = EXOTIC_CONFIG.format(model_dir=model_dir)
        records = exotic_records
    config = parse_pipeline_config_text(text)
    fb = FeatureBuilder(config)
    tm = TrainModule(config, fb, device="cpu")
    vals = records(64 * steps, 101)
    for i in range(steps):
        res = fb.build(vals[i * 64 : (i + 1) * 64])
        tm.train_step(res.batch)
    source = {"source": "kafka", "topic": "samples"}
    if delta_offset is not None:
        source["delta_topic_offset"] = delta_offset
    source.update(extra_source or {})
    path = CheckpointManager(model_dir).save(
        tm.global_step, tm.state_dict_for_checkpoint(), {0: 64 * steps}, source,
        config_to_text(config), generation="gen0")
    return TrainedCheckpoint(config, fb, tm, model_dir, path, records)


@torch.no_grad()
def apply_to_module(tm: TrainModule, maps, dense: dict, sparse: dict) -> None:
    """Applies a version's values (by id) to a TrainModule, the trainer-side reference."""
    dense_names = maps.dense_names()
    table_names = maps.table_names()
    params = tm.dense_parameters()
    for vid, arr in dense.items():
        params[dense_names[vid]].copy_(torch.from_numpy(np.asarray(arr, np.float32)))
    tables = tm.embedding_tables()
    for tid, (ids, vals) in sparse.items():
        t = tables[table_names[tid]]
        v = torch.from_numpy(np.asarray(vals, np.float32))
        t[torch.from_numpy(ids), : v.shape[1]] = v


def as_wide_and_deep(text: str, final_dnn: bool = False) -> str:
    """A datagen DeepFM config as EasyRec's WideAndDeep (same groups and towers)."""
    return as_model_config_text(text, "WideAndDeep", final_dnn=final_dnn)


def as_model(text: str, model: str) -> str:
    """A datagen DeepFM config as another model class (``as_model_config_text``)."""
    return as_model_config_text(text, model)


# Adagrad steps an element by lr * g / (sqrt(acc) + eps) (eps = 1e-8). Where the records'
# gradients of an element almost cancel, sqrt(acc) is near eps and the step is about
# lr * sign(g): the summation order (one process against several ranks) then moves it by up
# to lr * a few percent. Elements whose accumulator stays below this are compared loosely.
ILL_CONDITIONED_ACCUMULATOR = 1e-12


def assert_same(a: object, b: object, where: str = "") -> None:
    """Bitwise equality of nested dicts / lists of tensors and arrays."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, sorted(a), sorted(b))
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), where
    else:
        assert a == b, where


def assert_tables_close(got: dict, state: dict, atol: float, loose_atol: float = 1e-3) -> None:
    """Each embedding table of checkpoint ``state`` equals ``got[name]`` within ``atol``.

    Elements trained with an Adagrad accumulator in ``state`` still below
    ``ILL_CONDITIONED_ACCUMULATOR`` (at most 1 % of the trained elements) only within
    ``loose_atol``.
    """
    for name, t in state["model"].items():
        if not name.startswith("ebc.embedding_bags."):
            continue
        want, have = t.numpy(), np.asarray(got[name])
        acc = next((a.numpy() for a in state.get("sparse_optimizer", {}).get(name, {}).values()
                    if tuple(a.shape) == want.shape), None)
        loose = (np.zeros(want.shape, dtype=bool) if acc is None
                 else (acc > 0) & (acc < ILL_CONDITIONED_ACCUMULATOR))
        trained = want.size if acc is None else int((acc > 0).sum())
        assert loose.sum() <= max(1, trained // 100), (name, int(loose.sum()), trained)
        np.testing.assert_allclose(have[~loose], want[~loose], atol=atol, rtol=0,
                                   err_msg=name)
        np.testing.assert_allclose(have, want, atol=loose_atol, rtol=0, err_msg=name)


def _pool_rank(rank: int, world: int, tasks, results) -> None:  # noqa: ANN001 (queues)
    """One rank of a ``RankPool``: runs one task after another, each in a group of its own.

    A task is ``(target, port, args)``; the rank joins the group on ``port`` when
    ``target`` builds it (as under ``run_ranks``), hands back ``target(rank, *args)`` (or
    its error), leaves the group with the others (barrier, teardown) and reports that done.
    A failed task ends the process; so does ``None``. The process ends as a rank ends
    (``end_rank_process``: no interpreter teardown).
    """
    import traceback

    import torch.distributed as dist

    from odl.models.subnormal_floats import flush_subnormal_floats
    from odl.train.distributed import end_rank_process

    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    flush_subnormal_floats()  # as odl-train's ranks do
    code = 0
    while code == 0:
        task = tasks.get()
        if task is None:
            break
        target, port, args = task
        os.environ["MASTER_PORT"] = str(port)
        try:
            results.put((rank, "result", target(rank, *args)))
            dist.barrier()  # leave together: a group torn down under a peer can abort
            dist.destroy_process_group()
            results.put((rank, "left", None))
        except BaseException as e:  # reported to the caller, not lost in a child's stderr
            results.put((rank, "error", repr(e)))
            traceback.print_exc()
            code = 1
    results.close()
    results.join_thread()  # everything is in the pipe before the process ends
    end_rank_process(code)


class RankPool:
    """``world`` spawned CPU ranks that run one call after another: what
    ``odl.harness.spawned_ranks.run_ranks`` does, with the processes (and their imports)
    started once for many calls (the ``ranks`` fixture: once per test process).

    Each call's ranks join a new gloo group (the target builds it, as under ``run_ranks``,
    on a port of its own) and leave it before the call returns. A target must leave no
    state behind in its process (no monkeypatching, no threads still working). A failed
    call ends the processes; the next call starts new ones.
    """

    def __init__(self, world: int = 2) -> None:
        self.world = world
        self._procs: list = []
        self._tasks: list = []
        self._results = None

    def _start(self) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world)]
        self._procs = [ctx.Process(target=_pool_rank, daemon=True,
                                   args=(r, self.world, self._tasks[r], self._results))
                       for r in range(self.world)]
        for p in self._procs:
            p.start()

    def _get(self, timeout: float) -> tuple:
        import queue

        deadline = time.monotonic() + timeout
        while True:
            try:
                return self._results.get(timeout=1.0)
            except queue.Empty:
                dead = [p.exitcode for p in self._procs if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"a rank exited with {dead}" if dead
                                       else f"no answer of the ranks in {timeout:.0f}s"
                                       ) from None

    def run(self, target, *args, timeout: float = 240.0) -> dict:  # noqa: ANN001
        """Runs ``target(rank, *args)`` on every rank; rank -> what it returned.

        Raises:
            RuntimeError: a rank raised (its exception's text) or died.
        """
        from odl.harness.spawned_ranks import free_port

        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()
        port = free_port()
        for q in self._tasks:
            q.put((target, port, args))
        got: dict = {}
        left = 0
        while left < self.world:
            rank, kind, payload = self._get(timeout)
            if kind == "error":
                self.close()
                raise RuntimeError(f"rank {rank} of {self.world}: {payload}")
            if kind == "result":
                got[rank] = payload
            else:
                left += 1
        return got

    def close(self) -> None:
        """Ends the ranks (at once after a failure)."""
        for q in self._tasks:
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
        for p in self._procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(10)
        self._procs, self._tasks, self._results = [], [], None


def rank_dense_parameters(config, rank: int, steps: list) -> dict:
    """One rank of a ``RankPool`` training ``config`` from seed 0 on ``steps[k][rank]``'s
    records: per dense parameter, its values after the steps and whether they moved."""
    import torch

    from odl.features.feature_builder import FeatureBuilder
    from odl.train.train_module import TrainModule

    fb = FeatureBuilder(config)
    torch.manual_seed(0)
    tm = TrainModule(config, fb, device="cpu")
    first = {k: v.detach().clone() for k, v in tm.dense_parameters().items()}
    for step in steps:
        tm.train_step(fb.build(step[rank]).batch)
    return {k: (v.detach().numpy(), bool((v != first[k]).any()))
            for k, v in tm.dense_parameters().items()}
