"""The C kernels of a step's row reads (``row_pairs.c``) equal the torch code they replace.

On the CPU ``RowPairIndex.pairs`` and per-record Adagrad's row sums run in C; on other
devices, and where no C compiler works, in torch. Both must give the same reads and sums:
mean pooling, weighted values, two lookups of one table, a record reading a row twice and
lookups without values included.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from odl.datagen.datagen_config import bursty_config_text
from odl.models.ctr_model import PooledGroup
from odl.train.in_batch import native_kernels
from odl.train.in_batch.batch_row_pairs import RowPairIndex, TableRows
from odl.train.in_batch.held_rows import WholeTables
from odl.train.in_batch.per_record_adagrad import PerRecordAdagrad
from odl.train.in_batch.step_exchange import StepExchange
from tests.harness import load_config_text
from tests.test_in_batch_learning import _module, _records
from tests.test_per_record_adagrad import EASYREC_ADAGRAD, ROWWISE

B = 64
LAYOUT = [
    PooledGroup("wide", (("user", "user_wide"), ("tags", "tags_wide")), 1),
    PooledGroup("deep", (("user", "user_emb"), ("tags", "tags_emb"), ("item", "user_emb"),
                         ("absent", "absent_emb")), 0, (4, 3, 4, 2)),
]
TABLES = {"user_wide": TableRows(None, 4, False), "tags_wide": TableRows(None, 4, True),
          "user_emb": TableRows(None, 4, False), "tags_emb": TableRows(None, 3, True),
          "absent_emb": TableRows(None, 2, False)}


def _kjt(seed: int, weighted: bool) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    user = torch.randint(0, 12, (B,), generator=g)  # bursts: few users, rows read often
    tag_lengths = torch.randint(0, 4, (B,), generator=g)
    tags = torch.randint(0, 6, (int(tag_lengths.sum()),), generator=g)  # repeats in a record
    item = torch.randint(0, 30, (B,), generator=g)
    keys = ["item", "tags", "user", "absent"]
    lengths = torch.cat([torch.ones(B, dtype=torch.long), tag_lengths,
                         torch.ones(B, dtype=torch.long), torch.zeros(B, dtype=torch.long)])
    values = torch.cat([item, tags, user])
    weights = torch.rand(len(values), generator=g) + 0.5 if weighted else None
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, weights=weights)


def _both(monkeypatch, compute):
    """``compute()`` with the C kernels, then with the torch code."""
    if native_kernels.library() is None:
        pytest.skip("no C compiler here")
    native = compute()
    with monkeypatch.context() as m:
        m.setattr(native_kernels, "library", lambda: None)
        torch_result = compute()
    return native, torch_result


def _canonical(pairs, index: RowPairIndex) -> tuple[np.ndarray, ...]:
    """The pairs' fields, with reads of one (row, record) in a fixed order (either code may
    order them differently)."""
    key = index.row_keys(pairs.lookup.numpy(), pairs.rows.numpy()) * (B + 1) + pairs.sample.numpy()
    order = np.lexsort((pairs.weight.numpy(), pairs.lookup.numpy(), key))
    assert np.array_equal(key[order], key)  # both list the reads sorted by (row, record)
    return tuple(getattr(pairs, f).numpy()[order] for f in ("rows", "lookup", "sample", "weight"))


@pytest.mark.parametrize("weighted", [False, True])
def test_the_c_reads_equal_the_torch_reads(monkeypatch, weighted):
    index = RowPairIndex(LAYOUT, TABLES)
    kjt = _kjt(seed=int(weighted), weighted=weighted)
    native, by_torch = _both(monkeypatch, lambda: index.pairs(kjt, B, torch.float32))
    assert native.b == by_torch.b == B
    for a, b in zip(_canonical(native, index), _canonical(by_torch, index), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    for field in ("new_row", "new_pair", "row_start", "pair_start"):
        np.testing.assert_array_equal(getattr(native, field).numpy(),
                                      getattr(by_torch, field).numpy(), err_msg=field)
    assert native.new_row.dtype == torch.bool
    # the shared table: "item" and "user" read user_emb's rows, one row for both lookups
    shared = native.lookup.numpy()
    assert {2, 4} <= set(shared.tolist())
    # a record that reads a row twice: two reads in one (row, record) run
    assert int(native.new_pair.sum()) < len(native.new_pair)


@pytest.mark.parametrize("kind", ["adagrad", "rowwise_adagrad"])
def test_the_c_row_sums_equal_the_torch_row_sums(monkeypatch, kind):
    index = RowPairIndex(LAYOUT, TABLES, rowwise=kind == "rowwise_adagrad")
    pairs = index.pairs(_kjt(seed=5, weighted=True), B, torch.float32)
    per_record = PerRecordAdagrad(index, kind, 1e-8, 3.0, WholeTables(index),
                                  StepExchange(0, 1))
    g = torch.Generator().manual_seed(9)
    # a batch padded to the step's largest (the first B rows are its records); no gradient
    # reached the deep group
    grads = [torch.randn(B + 5, 2, generator=g), None]
    native, by_torch = _both(monkeypatch, lambda: per_record._row_sums(pairs, grads, B))
    for field in ("key", "lookup", "rows", "readers"):
        np.testing.assert_array_equal(getattr(native, field), getattr(by_torch, field),
                                      err_msg=field)
    np.testing.assert_allclose(native.total, by_torch.total, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(native.squares, by_torch.squares, rtol=1e-5, atol=1e-7)
    assert np.abs(native.total).max() > 0.1
    assert native.readers.max() > 1


@pytest.mark.parametrize("optimizer", ["adagrad", "rowwise"])
def test_training_steps_with_and_without_the_c_kernels_agree(tmp_path, monkeypatch, optimizer):
    """In-batch learning with per-record Adagrad and the adapted wide rate (a probe step
    included): the steps' shifted predictions, tables and wide rate are the same with the C
    kernels as with the torch code."""
    extra = ("in_batch_learning: true per_record_adagrad: true wide_rate_adaptation: true "
             "wide_learning_rate_multiplier: 3")
    records = _records(12 * 64)
    text = bursty_config_text(str(tmp_path / "m"), batch_size=64, sparse_lr=0.07,
                              dense_lr=0.001, buckets=4096, extra_train=extra)
    if optimizer == "rowwise":
        assert EASYREC_ADAGRAD in text
        text = text.replace(EASYREC_ADAGRAD, ROWWISE)
    config = load_config_text(text)

    def train() -> tuple[list[np.ndarray], dict[str, torch.Tensor], float]:
        tm, fb = _module(config)
        probs = [tm.train_step(fb.build(records[k:k + 64]).batch).probs
                 for k in range(0, len(records), 64)]
        return probs, tm.embedding_tables(), tm.wide_rate.multiplier

    (p_c, t_c, m_c), (p_t, t_t, m_t) = _both(monkeypatch, train)
    for a, b in zip(p_c, p_t, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    for name, table in t_c.items():
        torch.testing.assert_close(table, t_t[name], rtol=1e-4, atol=1e-6)
    assert m_c == pytest.approx(m_t, rel=1e-4)
