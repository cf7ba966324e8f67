"""Row-sparse table optimizers: Adam, FTRL, momentum, RMSProp, ... where fbgemm has no kernel.

fbgemm's fused table kernels cover SGD and (row-wise) Adagrad on CPU (Adam and LAMB on
CUDA); :mod:`odl.config.optimizer_support` says which configured kinds run here instead.
The tables stay TorchRec-sharded with the fused TBE kernel, run as exact SGD at rate 0 (its
update a no-op). :class:`RowSparseTables` hooks every TBE module
(``SplitTableBatchedEmbeddingBagsCodegen``) of the sharded collection: a training forward
records its inputs (indices, offsets, per-sample weights) and the gradient of its pooled
output (clamped to ``[-max_gradient, max_gradient]`` with TorchEasyRec's table
``gradient_clipping``, as fbgemm's kernels clamp it). After backward,
:meth:`RowSparseTables.apply` turns them into each touched row's summed gradient (a value
read by sample ``b`` through feature ``f`` gets ``grad_out[b, f's columns]``, times its
per-sample weight, over the bag's length under mean pooling) and applies the rule
(:class:`odl.train.row_sparse_rules.RowSparseRule`) to those rows of the TBE's weights and
of the state tensors kept here per table (``[rows, stored columns]`` each, ``[rows, 1]`` for
a state kept per row, ``row_sparse_rules.ROW_WISE_STATE``).
The cost follows the batch (its unique rows), not the table.

The TBE sees its inputs after TorchRec's input distribution, so with several ranks each
rank updates exactly the rows its shards hold, with the same code. The state joins the
fused optimizer's in :meth:`RowSparseTables.optimizer_view` (``TrainModule.fused_optimizer``),
so checkpoints, restores into any number of ranks and dynamic tables' row resets (to zero:
a fresh state, FTRL's accumulator being stored less its initial value) handle it as the
fused kernels' state: ``{"ebc.embedding_bags.<t>.weight": {"<t>.exp_avg": ...}}``.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from odl.models.embedding_tables import WIDE_SUFFIX
from odl.train.row_sparse_rules import ROW_WISE_STATE, RowSparseRule
from odl.train.table_shards import EBC_PREFIX

logger = logging.getLogger(__name__)

__all__ = ["RowSparseTables", "tbe_modules"]


@dataclass
class _Table:
    """One table of a TBE as this rank holds it."""

    name: str
    weight: torch.Tensor  # the TBE's live [rows, D] view
    state: list[torch.Tensor]
    lr_multiplier: float
    features: list[int]  # the TBE features looked up in it
    frozen: bool = False  # freeze_gradient: never updated (its state kept as it is)


@dataclass
class _Tbe:
    """One fused TBE module and its tables."""

    tables: list[_Table]
    d_offsets: list[int]  # per TBE feature, its first output column (and the total)
    mean: bool


@dataclass
class _Capture:
    """One training forward of a TBE: its inputs and, after backward, its output gradient."""

    tbe: _Tbe
    indices: torch.Tensor
    offsets: torch.Tensor
    weights: torch.Tensor | None
    grad: torch.Tensor | None = None


class _OptimizerView:
    """The fused optimizer with the row-sparse state joined into its ``state_dict``."""

    def __init__(self, fused: Any, states: dict[str, dict[str, Any]]) -> None:
        self._fused = fused
        self._states = states

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """None: the fused kernel stays at rate 0 (``RowSparseTables.apply`` takes the rate)."""
        return []

    def step(self) -> None:
        """Nothing to push (the fused kernel stays at rate 0)."""

    def state_dict(self) -> dict[str, Any]:
        """The fused optimizer's state dict, each table's row-sparse state added."""
        out = dict(self._fused.state_dict())
        state = {k: dict(v) for k, v in out.get("state", {}).items()}
        for pname, extra in self._states.items():
            state.setdefault(pname, {}).update(extra)
        out["state"] = state
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fused, name)


def tbe_modules(ebc: nn.Module) -> list[tuple[nn.Module, list[Any]]]:
    """``[(fbgemm TBE module, its tables' configs)]`` of a sharded collection."""
    out = []
    lookups = [m for lk in getattr(ebc, "_lookups", []) for m in lk.modules()]
    for mod in lookups:
        emb = getattr(mod, "_emb_module", None)
        config = getattr(mod, "_config", None)
        if emb is not None and config is not None and hasattr(emb, "split_embedding_weights"):
            out.append((emb, list(config.embedding_tables)))
    return out


class RowSparseTables:
    """The row-sparse optimizer of a sharded model's tables (module docstring).

    Args:
        dmp: the ``DistributedModelParallel`` model (tables under ``module.ebc``).
        rule: the update rule.
        wide_multiplier: the wide tables' rate over the other tables'.
        world_size: the ranks; with several the state is exposed as ShardedTensors laid out
            as the weights.
        max_gradient: clamp each captured pooled-output gradient to ``[-max_gradient,
            max_gradient]`` (TorchEasyRec's table ``gradient_clipping``, as fbgemm's kernels
            clamp it); None: no clipping.
        frozen: tables ``freeze_gradient`` froze (``odl.train.frozen_parameters``): kept
            with their state, never updated.

    Raises:
        RuntimeError: a TBE's layout is not one this module reads.
    """

    def __init__(self, dmp: nn.Module, rule: RowSparseRule, wide_multiplier: float = 1.0,
                 world_size: int = 1, max_gradient: float | None = None,
                 frozen: Collection[str] = ()) -> None:
        self.rule = rule
        self._max_gradient = max_gradient
        self._pending: list[_Capture] = []
        self._tbes: list[_Tbe] = []
        self._hooks: list[Any] = []
        self._states: dict[str, dict[str, Any]] = {}
        self._multipliers: dict[str, float] = {}
        model_state = dmp.state_dict()
        for emb, configs in tbe_modules(dmp.module.ebc):
            mode = int(getattr(emb.pooling_mode, "value", emb.pooling_mode))
            if mode not in (0, 1):  # fbgemm PoolingMode SUM = 0, MEAN = 1
                raise RuntimeError(f"row-sparse tables need sum or mean pooling, got {mode}")
            weights = emb.split_embedding_weights()
            ftm = [int(t) for t in emb.feature_table_map]
            tables = []
            for k, (cfg, w) in enumerate(zip(configs, weights, strict=True)):
                name = cfg.name
                mult = wide_multiplier if name.endswith(WIDE_SUFFIX) else 1.0
                self._multipliers[name] = mult
                state = [torch.zeros(_state_shape(s, w), dtype=torch.float32, device=w.device)
                         for s in rule.state_names]
                tables.append(_Table(name, w, state, mult,
                                     [f for f, t in enumerate(ftm) if t == k],
                                     name in frozen))
                pname = f"{EBC_PREFIX}{name}.weight"
                self._states[pname] = {
                    f"{name}.{s}": (v if world_size == 1
                                    else _like_weight(model_state[pname], v))
                    for s, v in zip(rule.state_names, state, strict=True)}
            tbe = _Tbe(tables, [int(d) for d in emb.D_offsets.tolist()], mode == 1)
            self._tbes.append(tbe)
            self._hooks.append(emb.register_forward_hook(self._forward_hook(tbe),
                                                         with_kwargs=True))
        logger.info("row-sparse %s for %d tables", rule.kind,
                    sum(len(t.tables) for t in self._tbes))

    def _forward_hook(self, tbe: _Tbe) -> Any:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> None:
            if not (module.training and torch.is_grad_enabled() and output.requires_grad):
                return
            if kwargs.get("batch_size_per_feature_per_rank") is not None:
                raise RuntimeError("row-sparse table optimizers do not support variable "
                                   "batch sizes per feature")
            named = dict(zip(("indices", "offsets", "per_sample_weights"), args,
                             strict=False))
            named.update(kwargs)
            psw = named.get("per_sample_weights")
            cap = _Capture(tbe, named["indices"].detach(), named["offsets"].detach(),
                           psw.detach() if psw is not None else None)

            def keep(grad: torch.Tensor) -> None:
                bound = self._max_gradient
                cap.grad = grad.detach() if bound is None else grad.detach().clamp(-bound, bound)

            output.register_hook(keep)
            self._pending.append(cap)

        return hook

    def optimizer_view(self, fused: Any) -> _OptimizerView:
        """The fused optimizer as checkpoints see it, the row-sparse state joined in."""
        return _OptimizerView(fused, self._states)

    @torch.no_grad()
    def apply(self, lr: float, t: int) -> int:
        """Updates the rows the last backward touched (call after backward).

        Args:
            lr: the tables' rate of the step (the wide tables take their multiple).
            t: the global step counting this one (Adam's bias correction).

        Returns:
            The number of rows updated, over all tables of this rank.
        """
        pending, self._pending = self._pending, []
        done = 0
        for cap in pending:
            if cap.grad is not None:
                done += self._apply_capture(cap, lr, t)
        return done

    def _apply_capture(self, cap: _Capture, lr: float, t: int) -> int:
        tbe, grad, offsets, indices = cap.tbe, cap.grad, cap.offsets, cap.indices
        assert grad is not None
        n_features = len(tbe.d_offsets) - 1
        b = (offsets.numel() - 1) // max(1, n_features)
        lengths = offsets[1:] - offsets[:-1]
        bounds = offsets.tolist()
        done = 0
        for table in tbe.tables:
            if table.frozen:
                continue
            rows, grads = [], []
            for f in table.features:
                lo, hi = bounds[f * b], bounds[(f + 1) * b]
                if hi == lo:
                    continue
                bag = lengths[f * b:(f + 1) * b]
                sample = torch.repeat_interleave(torch.arange(b, device=bag.device), bag)
                g = grad[:, tbe.d_offsets[f]:tbe.d_offsets[f + 1]].index_select(
                    0, sample.to(grad.device)).float()
                scale = cap.weights[lo:hi].float() if cap.weights is not None else None
                if tbe.mean:
                    inv = (1.0 / bag.clamp(min=1).to(torch.float32)).index_select(0, sample)
                    scale = inv if scale is None else scale * inv
                if scale is not None:
                    g = g * scale.to(g.device).unsqueeze(1)
                rows.append(indices[lo:hi].long())
                grads.append(g)
            if rows:
                done += self._update(table, torch.cat(rows), torch.cat(grads), lr, t)
        return done

    def _update(self, table: _Table, rows: torch.Tensor, grads: torch.Tensor, lr: float,
                t: int) -> int:
        w_all = table.weight
        rows = rows.to(w_all.device)
        unique, inverse = torch.unique(rows, return_inverse=True)
        summed = torch.zeros((unique.numel(), grads.shape[1]), dtype=torch.float32,
                             device=w_all.device).index_add_(0, inverse, grads.to(w_all.device))
        w = w_all.index_select(0, unique).float()
        state = [s.index_select(0, unique) for s in table.state]
        new_w, new_state = self.rule.apply(w, summed, state, lr * table.lr_multiplier, t)
        w_all.index_copy_(0, unique, new_w.to(w_all.dtype))
        for s, v in zip(table.state, new_state, strict=True):
            s.index_copy_(0, unique, v)
        return int(unique.numel())

    def upgrade_state(self, state: dict[str, Any], rates: Any) -> dict[str, Any]:
        """A whole checkpoint state written before the tables ran row-sparse, made loadable.

        Earlier versions ran FTRL tables as fbgemm Adagrad (state ``<t>.momentum1``, the
        sum of squared gradients), momentum tables as SGD (no state) and AdamW tables on
        CUDA as fbgemm Adam (``<t>.momentum1`` / ``<t>.momentum2``: Adam's moments; the
        same names as fbgemm's Adam and LAMB state on CUDA, so such a checkpoint restores
        into row-sparse Adam / LAMB tables on a CPU). Their
        state becomes this rule's: FTRL takes the accumulator and the linear term ``z`` that
        keeps each weight where it is (``w = (sign(z) * l1 - z) / quadratic``), Adam the
        moments, row-wise Adagrad with decay fbgemm's fused row-wise accumulator (a
        checkpoint of a CUDA run restored on a CPU), anything else a fresh (zero) state. A
        state that has the rule's names, or a checkpoint read in parts (``table_parts``), is
        returned as is.

        Args:
            state: ``TrainModule.state_dict_for_checkpoint()``'s form.
            rates: the module's ``LearningRates`` (FTRL's ``z`` takes the tables' rate at
                the restored step).

        Returns:
            The state to load.
        """
        saved = state.get("sparse_optimizer") or {}
        if state.get("table_parts") or not saved:
            return state
        upgraded = dict(saved)
        lr = float(rates.at(int(state.get("global_step", 0)))[0])
        for pname, ours in self._states.items():
            entries = saved.get(pname, {})
            if all(k in entries for k in ours):
                continue
            name = pname[len(EBC_PREFIX):-len(".weight")]
            weight = state.get("model", {}).get(pname)
            if weight is None:
                continue
            upgraded[pname] = self._upgraded(name, entries, torch.as_tensor(weight).float(),
                                             lr * self._multipliers[name])
            logger.warning("table %s: optimizer state %s of a checkpoint written before "
                           "%s tables ran row-sparse, carried over as %s", name,
                           sorted(entries) or "(none)", self.rule.kind, sorted(ours))
        return {**state, "sparse_optimizer": upgraded}

    def _upgraded(self, name: str, entries: dict[str, Any], w: torch.Tensor,
                  lr: float) -> dict[str, torch.Tensor]:
        old = {k.rsplit(".", 1)[-1]: torch.as_tensor(v).float() for k, v in entries.items()}
        new = [torch.zeros(_state_shape(s, w)) for s in self.rule.state_names]
        m1, m2 = old.get("momentum1"), old.get("momentum2")
        if self.rule.kind == "ftrl" and m1 is not None and m1.shape == w.shape and lr > 0:
            p = self.rule.params
            n = m1 + float(p.get("initial_accumulator_value", 0.1))
            quad = n.pow(-float(p.get("lr_power", -0.5))) / lr + 2.0 * float(p.get("l2", 0.0))
            new = [m1, -w * quad - torch.sign(w) * float(p.get("l1", 0.0))]
        elif self.rule.kind in ("adam", "adamw", "lamb") and m1 is not None and m2 is not None \
                and m1.shape == w.shape == m2.shape:
            new = [m1, m2]
        elif self.rule.kind == "rowwise_adagrad_with_decay" and m1 is not None \
                and m1.numel() == w.shape[0]:  # fbgemm's fused row-wise accumulator
            new = [m1.reshape(-1, 1)]
        return {f"{name}.{s}": v for s, v in zip(self.rule.state_names, new, strict=True)}

    def close(self) -> None:
        """Removes the forward hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


def _state_shape(name: str, weight: torch.Tensor) -> tuple[int, int]:
    """The shape of a state tensor of a table: the weights', or one column per row."""
    rows, dim = weight.shape
    return (int(rows), 1 if name in ROW_WISE_STATE else int(dim))


def _like_weight(weight: Any, local: torch.Tensor) -> Any:
    """``local`` as a ShardedTensor laid out as this rank's shard of ``weight``.

    A state of one column per row keeps the shard's rows with one column.
    """
    import copy

    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

    shards = weight.local_shards()
    if len(shards) != 1 or shards[0].tensor.shape[0] != local.shape[0]:
        raise RuntimeError("row-sparse tables need one shard of each table per rank")
    width = int(local.shape[1])
    if width == shards[0].tensor.shape[1]:
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            [Shard(local, shards[0].metadata)], weight.metadata())
    # a state of one column per row: every shard keeps its rows, with `width` columns
    meta = copy.deepcopy(weight.metadata())
    full = int(meta.size[1])
    for m in meta.shards_metadata:
        if m.shard_offsets[1] != 0 or m.shard_sizes[1] != full:
            raise RuntimeError("a row-wise optimizer state needs tables split by rows, not "
                               "by columns")
        m.shard_sizes = [m.shard_sizes[0], width]
    meta.size = torch.Size([int(meta.size[0]), width])
    own = next(m for m in meta.shards_metadata
               if m.shard_offsets[0] == shards[0].metadata.shard_offsets[0]
               and m.placement == shards[0].metadata.placement)
    return ShardedTensor._init_from_local_shards_and_global_metadata([Shard(local, own)], meta)
