"""The CUDA path: device choice, CPU/CUDA agreement, checkpoints across devices, online loop.

Skipped where no CUDA device is visible (CI has none). On a GPU machine these need
``fbgemm-gpu`` (the CUDA build) instead of ``fbgemm-gpu-cpu``; see docs/training.md#gpu.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from odl.checkpoint.checkpoint_manager import list_checkpoints, read_checkpoint
from odl.features.feature_builder import FeatureBuilder
from odl.harness.exactly_once_audit import ledger_sample_ids
from odl.harness.topic_records import make_records as make_stream_records
from odl.harness.topic_records import produce
from odl.kafka.topic_admin import end_offsets
from odl.train.torch_runtime import resolve_device
from odl.train.train_module import TrainModule
from tests.harness import run_in_process, write_config
from tests.test_models import batches, config, make_records, roc_auc

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def fb():
    return FeatureBuilder(config())


def _assert_tables_equal(a: TrainModule, b: TrainModule, atol: float) -> None:
    ta, tb = a.embedding_tables(), b.embedding_tables()
    assert set(ta) == set(tb)
    for name in ta:
        torch.testing.assert_close(ta[name].cpu(), tb[name].cpu(), atol=atol, rtol=0)


def test_auto_device_is_cuda_with_tables_on_the_gpu(fb):
    import fbgemm_gpu

    assert getattr(fbgemm_gpu, "__variant__", "") != "cpu", "fbgemm-gpu-cpu cannot train on CUDA"
    assert resolve_device("auto").type == "cuda"
    tm = TrainModule(config(), fb, device="auto")
    assert tm.device.type == "cuda"
    assert all(w.is_cuda for w in tm.embedding_tables().values())
    assert all(p.is_cuda for p in tm.dense_parameters().values())
    out = tm.train_step(batches(fb, 1, size=64)[0])  # a CPU batch is moved to the model
    assert out.probs.shape == (64,) and np.isfinite(out.loss)


def test_cuda_trains_the_same_model_as_cpu(fb):
    cpu = TrainModule(config(), fb, device="cpu")
    gpu = TrainModule(config(), fb, device="cuda")
    _assert_tables_equal(cpu, gpu, atol=0)  # same seed, same initial weights on both
    for b in batches(fb, 20, size=256, seed=5):
        oc, og = cpu.train_step(b), gpu.train_step(b)
        np.testing.assert_allclose(og.probs, oc.probs, atol=1e-4, rtol=0)
        assert abs(og.loss - oc.loss) < 1e-4
    # fused Adagrad on the tables and Adam on the dense part made the same updates
    _assert_tables_equal(cpu, gpu, atol=1e-4)
    for name, p in cpu.dense_parameters().items():
        torch.testing.assert_close(gpu.dense_parameters()[name].cpu(), p, atol=1e-4, rtol=0)


@pytest.mark.parametrize("sample", ["dbmtl_uniter_on_movielens", "dbmtl_cmbf_on_movielens",
                                    "deepfm_multi_cls_small", "cmbf_on_movielens",
                                    "uniter_on_movielens", "bst_on_taobao",
                                    "autoint_on_movielens", "rocket_launching_feature_based",
                                    "simple_multi_task_on_taobao",
                                    "taobao_multi_tower_boundary_test",
                                    "torcheasyrec/pepnet_taobao"])
def test_easyrec_samples_of_new_parts_train_alike_on_cuda_and_cpu(sample, device="cuda"):
    """EasyRec's UNITER and CMBF bottoms and models, its distillation sample, MultiTowerBST,
    AutoInt, RocketLaunching, SimpleMultiTask, projected raw features in a tower and
    TorchEasyRec's PEPNet (dropout off): the CUDA steps predict what the CPU steps
    predict."""
    from tests.test_config_compat import _HERE, _records, _small_cpu_config, try_load

    flavor, name = sample.split("/") if "/" in sample else ("easyrec", sample)
    config = _small_cpu_config(try_load.load_one(
        os.path.join(_HERE, flavor, f"{name}.config"), flavor))
    config.model_dir = "unused"
    mc = config.model_config
    if mc.HasField("pepnet"):
        mc.pepnet.ClearField("ppnet_dropout_ratio")
    layers = [getattr(mc.dbmtl, n) for n in ("bottom_uniter", "bottom_cmbf")
              if mc.HasField("dbmtl") and mc.dbmtl.HasField(n)]
    layers += [getattr(mc, n).config for n in ("cmbf", "uniter") if mc.HasField(n)]
    for layer in layers:
        for key in ("hidden_dropout_prob", "attention_probs_dropout_prob",
                    "text_seq_emb_dropout_prob"):
            if key in layer.DESCRIPTOR.fields_by_name:
                setattr(layer, key, 0.0)
    fb = FeatureBuilder(config)
    cpu, gpu = TrainModule(config, fb, device="cpu"), TrainModule(config, fb, device=device)
    for step in range(3):
        batch = fb.build(_records(config, 32, seed=step)).batch
        np.testing.assert_allclose(gpu.train_step(batch).probs, cpu.train_step(batch).probs,
                                   atol=1e-4, rtol=0)


def test_checkpoints_cross_devices_both_ways(fb):
    gpu = TrainModule(config(), fb, device="cuda")
    for b in batches(fb, 4, size=128, seed=2):
        gpu.train_step(b)
    state = gpu.state_dict_for_checkpoint()
    tensors = list(state["model"].values()) + [
        v for per_table in state["sparse_optimizer"].values() for v in per_table.values()]
    assert all(t.device.type == "cpu" for t in tensors)  # checkpoints are device-neutral

    cpu = TrainModule(config(train_config="seed: 8"), fb, device="cpu")
    cpu.load_checkpoint_state(state)
    assert cpu.global_step == 4
    nxt = batches(fb, 3, size=128, seed=3)
    np.testing.assert_allclose(cpu.predict(nxt[0]), gpu.predict(nxt[0]), atol=1e-5, rtol=0)
    for b in nxt:  # optimizer state came along: the next updates agree as well
        np.testing.assert_allclose(cpu.train_step(b).probs, gpu.train_step(b).probs,
                                   atol=1e-4, rtol=0)

    back = TrainModule(config(train_config="seed: 9"), fb, device="cuda")
    back.load_checkpoint_state(cpu.state_dict_for_checkpoint())
    _assert_tables_equal(back, cpu, atol=0)


def test_adam_on_the_tables_learns_on_cuda(fb):
    c = config(train_config="sparse_optimizer { adam_optimizer { lr: 0.01 } }")
    tm = TrainModule(c, fb, device="cuda")
    eval_recs, eval_labels = make_records(4000, seed=999)
    eval_batch = fb.build(eval_recs).batch
    for b in batches(fb, 60, size=256, seed=1):
        tm.train_step(b)
    assert roc_auc(eval_labels, tm.predict(eval_batch)) > 0.75


@pytest.mark.parametrize("tables", ["adam_optimizer { lr: 0.01 weight_decay: 0.01 }",
                                    "lamb_optimizer { lr: 0.01 weight_decay: 0.01 }"],
                         ids=["adam", "lamb"])
def test_frozen_tables_keep_their_rows_under_fused_kernels_on_cuda(fb, tables):
    """freeze_gradient where fbgemm's fused Adam / LAMB with weight decay run (CUDA): the
    frozen table's own group stays at rate 0, so its rows stay while the others train."""
    first = fb.table_specs[0].name
    c = config(train_config=f"sparse_optimizer {{ {tables} }} dense_optimizer {{ adam_optimizer "
               f'{{ lr: 0.001 }} }} freeze_gradient: "embedding_bags.{first}.weight"')
    tm = TrainModule(c, fb, device="cuda")
    assert tm.row_sparse is None and tm.frozen.tables == {first}
    start = {k: v.detach().clone() for k, v in tm.embedding_tables().items()}
    for b in batches(fb, 10, size=256, seed=7):
        tm.train_step(b)
    for name, table in tm.embedding_tables().items():  # (LAMB leaves zero wide rows at 0)
        if not name.endswith("_wide"):
            assert torch.equal(table, start[name]) == (name == first), name


@pytest.mark.parametrize("tables", [
    "lamb_optimizer { lr: 0.01 weight_decay: 0.01 }",
    "adam_optimizer { lr: 0.01 weight_decay: 0.01 }",
    "rowwise_adagrad_optimizer { lr: 0.05 weight_decay: 0.01 weight_decay_mode: L2 }",
    "rowwise_adagrad_optimizer { lr: 0.05 weight_decay: 0.01 weight_decay_mode: DECOUPLE }",
    "adam_optimizer { lr: 0.01 gradient_clipping: true max_gradient: 0.0005 }",
    "lamb_optimizer { lr: 0.01 gradient_clipping: true max_gradient: 0.0005 }",
], ids=["lamb", "adam", "rowwise_adagrad_l2", "rowwise_adagrad_decouple", "adam_clipped",
        "lamb_clipped"])
def test_decaying_tables_fused_on_cuda_equal_row_sparse_on_cpu(fb, tables):
    """TorchEasyRec's LAMB, Adam and row-wise Adagrad tables with weight_decay or
    gradient_clipping: fbgemm's fused kernel on CUDA and the row-sparse rule on the CPU make
    the same updates."""
    c = config(train_config=f"sparse_optimizer {{ {tables} }} "
               "dense_optimizer { adam_optimizer { lr: 0.001 } }")
    cpu = TrainModule(c, fb, device="cpu")
    gpu = TrainModule(c, fb, device="cuda")
    assert cpu.row_sparse is not None and gpu.row_sparse is None
    for b in batches(fb, 10, size=256, seed=7):
        oc, og = cpu.train_step(b), gpu.train_step(b)
        np.testing.assert_allclose(og.probs, oc.probs, atol=1e-4, rtol=0)
    _assert_tables_equal(cpu, gpu, atol=1e-4)


@pytest.mark.parametrize("optimizer", [
    "ftrl_optimizer { learning_rate { constant_learning_rate { learning_rate: 0.1 } } "
    "l1_reg: 0.001 l2_reg: 0.01 }",
    "momentum_optimizer { learning_rate { constant_learning_rate { learning_rate: 0.05 } } "
    "momentum_optimizer_value: 0.9 }",
    "adagrad_decay_optimizer { learning_rate { constant_learning_rate { learning_rate: 0.1 } } "
    "accumulator_decay_step: 3 accumulator_decay_rate: 0.5 }",
])
def test_row_sparse_tables_on_cuda_equal_cpu(fb, optimizer):
    """FTRL, momentum and AdagradDecay tables (no fbgemm kernel on any device) update the
    touched rows on CUDA as on the CPU."""
    text = (f"optimizer_config {{ {optimizer} }} "
            "optimizer_config { adam_optimizer { learning_rate { constant_learning_rate { "
            "learning_rate: 0.001 } } } }")
    c = config(train_config=text)
    c.train_config.ClearField("sparse_optimizer")
    c.train_config.ClearField("dense_optimizer")
    cpu = TrainModule(c, fb, device="cpu")
    gpu = TrainModule(c, fb, device="cuda")
    assert cpu.row_sparse is not None and gpu.row_sparse is not None
    for b in batches(fb, 10, size=256, seed=6):
        oc, og = cpu.train_step(b), gpu.train_step(b)
        np.testing.assert_allclose(og.probs, oc.probs, atol=1e-4, rtol=0)
    _assert_tables_equal(cpu, gpu, atol=1e-4)


def test_online_loop_on_cuda_trains_every_record_once(kafka_bootstrap, kafka_topic_factory,
                                                      tmp_path):
    topic = kafka_topic_factory(partitions=3)
    ids, values = make_stream_records(3000, seed=11)
    produce(kafka_bootstrap, topic, values, 3)
    ends = end_offsets(kafka_bootstrap, topic)
    cfg = write_config(tmp_path, kafka_bootstrap, topic, batch_size=256)
    ledger = str(tmp_path / "ledger.tsv")
    trainer = run_in_process(cfg, ends, ledger, device="cuda")
    assert trainer.module.device.type == "cuda"
    trained = ledger_sample_ids(ledger)
    assert sorted(trained) == sorted(ids)
    ckpt = read_checkpoint(list_checkpoints(trainer.model_dir)[-1])
    assert ckpt.positions == ends
    assert ckpt.global_step == trainer.module.global_step


def test_in_batch_learning_on_cuda_equals_cpu(tmp_path):
    """The in-batch shift (sorts, prefix sums, accumulator reads) gives the CPU's predictions,
    and the same tables, on CUDA."""
    from odl.datagen.bursty_stream import BurstyStream
    from odl.datagen.datagen_config import bursty_config_text
    from tests.harness import load_config_text

    cfg = load_config_text(bursty_config_text(
        str(tmp_path / "m"), batch_size=256, buckets=4096,
        extra_train="in_batch_learning: true wide_learning_rate_multiplier: 3"))
    fbb = FeatureBuilder(cfg)
    records = BurstyStream(seed=2).next_batch(2560).encode("csv")
    cpu = TrainModule(cfg, fbb, device="cpu")
    gpu = TrainModule(cfg, fbb, device="cuda")
    for k in range(0, len(records), 256):
        b = fbb.build(records[k:k + 256]).batch
        oc, og = cpu.train_step(b), gpu.train_step(b)
        np.testing.assert_allclose(og.probs, oc.probs, atol=1e-4, rtol=0)
    _assert_tables_equal(cpu, gpu, atol=1e-4)


def test_dynamic_tables_on_cuda_equal_cpu(tmp_path):
    """Admission, expiry, eviction and the row remap give the CPU's predictions, tables and
    id index on CUDA (the index lives on the host either way)."""
    from tests.test_dynamic_tables import _config as dynamic_config
    from tests.test_dynamic_tables import _records as dynamic_records

    cfg = dynamic_config(str(tmp_path / "m"))
    fbd = FeatureBuilder(cfg)
    records = dynamic_records(64 * 30, seed=3)
    cpu = TrainModule(cfg, fbd, device="cpu")
    gpu = TrainModule(cfg, fbd, device="cuda")
    for k in range(0, len(records), 64):
        b = fbd.build(records[k:k + 64]).batch
        oc, og = cpu.train_step(b), gpu.train_step(b)
        np.testing.assert_allclose(og.probs, oc.probs, atol=1e-4, rtol=0)
    assert cpu.dynamic.tables and set(cpu.dynamic.tables) == set(gpu.dynamic.tables)
    ids = np.arange(-5, 200)
    for name, table in cpu.dynamic.tables.items():
        np.testing.assert_array_equal(gpu.dynamic.tables[name].lookup(ids), table.lookup(ids))
    _assert_tables_equal(cpu, gpu, atol=1e-4)


def _rank_on_its_gpu(rank: int, world: int, model_dir: str, schedule: list) -> tuple:
    """One rank of ``test_two_nccl_ranks_train_as_one_process``, on ``cuda:<rank>``."""
    from tests.test_distributed_training import ROW_WISE_MIN_ROWS, _config, _tables

    torch.cuda.set_device(rank)
    config = _config(model_dir)
    fbr = FeatureBuilder(config)
    tm = TrainModule(config, fbr, device=f"cuda:{rank}", row_wise_min_rows=ROW_WISE_MIN_ROWS)
    probs = [tm.train_step(fbr.build(step[rank]).batch).probs for step in schedule]
    tables = _tables(tm.state_dict_for_checkpoint())  # gathered on rank 0
    dense = {k: v.detach().cpu().numpy() for k, v in tm.dense_parameters().items()}
    return np.concatenate(probs), tables, dense


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="needs 2 GPUs: TorchRec places rank r's table shards on cuda:r")
def test_two_nccl_ranks_train_as_one_process(tmp_path):
    """Two NCCL ranks, one GPU each, train the model one CUDA process trains on the whole
    batches: predictions, gathered tables and dense parameters."""
    from odl.datagen.bursty_stream import BurstyStream
    from odl.harness.spawned_ranks import run_ranks
    from tests.test_distributed_training import BATCH, _config, _even, _merged_probs, _tables

    world = 2
    records = BurstyStream(seed=4).next_batch(6 * BATCH).encode("csv")
    got = run_ranks(_rank_on_its_gpu, world, world, str(tmp_path / "m"),
                    _even(records, world))
    config = _config(str(tmp_path / "one"))
    fbo = FeatureBuilder(config)
    one = TrainModule(config, fbo, device="cuda")
    probs = np.concatenate([one.train_step(fbo.build(records[k:k + BATCH]).batch).probs
                            for k in range(0, len(records), BATCH)])
    np.testing.assert_allclose(_merged_probs(got, world, len(records)), probs, atol=1e-4,
                               rtol=0)
    tables = _tables(one.state_dict_for_checkpoint())
    assert set(got[0][1]) == set(tables) and got[1][1] == {}
    for name, t in tables.items():
        np.testing.assert_allclose(got[0][1][name], t, atol=1e-4, rtol=0, err_msg=name)
    for name, v in one.dense_parameters().items():
        for r in range(world):
            np.testing.assert_allclose(got[r][2][name], v.detach().cpu().numpy(), atol=1e-4,
                                       rtol=0, err_msg=f"rank {r} {name}")
