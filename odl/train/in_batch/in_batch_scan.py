"""Sequential in-batch learning: the batch's earlier records count with their own shifted errors.

In-batch learning (``odl.train.in_batch.in_batch_learning``) shifts record ``i``'s logit by the
first-order change that the batch's earlier records' table steps make to the rows ``i``
reads. Which errors those earlier records step with decides how close that comes to a
per-sample learner. With ``train_config.in_batch_sequential`` they are the errors of the
earlier records' *own shifted* predictions, as a per-sample learner would have had them:
on a burst of one user's events the first records' errors shrink as the burst is learned,
and the later records' shifts stop growing, instead of every earlier record adding its
error at the batch's starting state.

Contract (``InBatchScan.shift``). With the notation of ``odl.train.in_batch.in_batch_learning``
(``S_r(i)`` the gradient of row ``r`` from the records before ``i``, ``D_r(i)`` the change
one optimizer step makes with it, ``a_if`` a read's weight), every record ``i`` in batch
order gets ``shift_i = sum over its reads f of a_if * <dlogit_i/de_if, D_r(i)>`` where

* ``S_r(i) = sum over j < i reading r of e_j * a_jf * dlogit_j/de_jf``, ``e_j`` the slope of
  record ``j``'s loss at its *shifted* logit ``l_j + shift_j``;
* ``D_r(i)`` is the step of the table's optimizer as in ``odl.train.in_batch.in_batch_learning``,
  except that with ``per_record_adagrad`` the accumulator grows by ``max(Q_r(i), S_r(i)**2 /
  c**2)`` (``Q_r(i)`` the sum of the earlier records' squared gradients of ``r``, ``c`` the
  largest gain), the growth that rule's update gives the row.

The shifts solve a recurrence (record ``i``'s error depends on the shifts before it), so
they are found in one pass over the records in order (``in_batch_scan.c``, compiled on first
use with the system C compiler by ``odl.train.in_batch.native_kernels``; a Python pass of the
same arithmetic where there is none).
The pass needs each record's error as a function of its logit: it is modelled from the
loss's slope and curvature (``fit_errors``: exact for cross entropy and L2 losses, one pass),
and for other losses the pass is repeated from the logits it reached (``InBatchScan.shift``,
at most ``ITERATIONS`` passes). A record's slope must depend on its own logit only: losses
that couple records (pairwise, JRC) are refused by validation. With several ranks the pass
runs over every rank's records of the step, each rank giving its records' slopes between
passes (``odl.train.in_batch.in_batch_learning``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from odl.protos import pipeline_pb2
from odl.train.in_batch import native_kernels
from odl.train.in_batch.batch_row_pairs import argsort
from odl.train.in_batch.native_kernels import address as _ptr

ITERATIONS = 4  # passes at most
TOLERANCE = 1e-3  # the error model's largest miss, relative to the largest error, that ends
# the passes

KINDS = {"sgd": 0, "adagrad": 1, "rowwise_adagrad": 2}


def native_pass_available() -> bool:
    """True when the compiled pass is in use (compiles it on the first call)."""
    return native_kernels.library() is not None


@dataclass(frozen=True)
class ScanPairs:
    """One step's pairs, prepared for the pass (CPU arrays, ``P`` pairs, ``U`` rows).

    Attributes:
        order: the pairs in (record, row) order.
        sample: each pair's record.
        slot: each pair's row, numbered ``0..U-1``.
        jrow: ``[P, width]`` each pair's ``dlogit/de`` of its lookup.
        weight: each pair's read weight.
        cols: ``[U]`` each row's table width (``jrow``'s columns beyond it are zero).
        rate: ``[U]`` each row's table rate.
        acc: ``[U, acc_width]`` each row's accumulator (row-wise: ``[U, 1]``; SGD:
            ``[U, 0]``).
        stored: ``[U]`` each row's table's stored columns (row-wise Adagrad's divisor).
        slots: ``U``.
    """

    order: np.ndarray
    sample: np.ndarray
    slot: np.ndarray
    cols: np.ndarray
    jrow: np.ndarray
    weight: np.ndarray
    rate: np.ndarray
    acc: np.ndarray
    stored: np.ndarray
    slots: int


def _f32(t: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(t.detach().to("cpu", torch.float32).numpy())


def _i64(t: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(t.detach().to("cpu", torch.int64).numpy())


def record_order(sample: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """The permutation that puts pairs in (record, row) order, the pass's order."""
    slots = int(slot.max()) + 1 if slot.numel() else 1
    return argsort(sample.long() * slots + slot.long())


def scan_pairs(sample: torch.Tensor, slot: torch.Tensor, jrow: torch.Tensor,
               weight: torch.Tensor, rate: torch.Tensor, acc: torch.Tensor | None,
               stored: torch.Tensor, cols: torch.Tensor | None = None,
               in_record_order: bool = False) -> ScanPairs:
    """``ScanPairs`` from a step's pairs, in any order, and their rows.

    Args:
        sample: ``[P]`` each pair's record.
        slot: ``[P]`` each pair's row, numbered ``0..U-1``.
        jrow: ``[P, width]`` ``dlogit/de`` per pair (``RowPairIndex.per_pair``).
        weight: ``[P]`` each pair's read weight.
        rate: ``[U]`` each row's table rate (multiplier applied).
        acc: ``[U, acc_width]`` each row's accumulator, None for SGD.
        stored: ``[U]`` each row's table's stored columns.
        cols: ``[U]`` each row's table width (None: ``jrow``'s width).
        in_record_order: the pairs already are in ``record_order`` (the pass then reads
            them in sequence, which is faster).

    Returns:
        The prepared pairs.
    """
    p = sample.numel()
    slots = int(rate.numel())
    order = (torch.arange(p) if in_record_order else record_order(sample, slot))
    return ScanPairs(
        order=_i64(order), sample=_i64(sample), slot=_i64(slot), jrow=_f32(jrow),
        weight=_f32(weight),
        cols=(_i64(cols) if cols is not None
              else np.full(slots, jrow.shape[1] if jrow.dim() > 1 else 0, dtype=np.int64)),
        rate=_f32(rate),
        acc=_f32(acc) if acc is not None else np.zeros((slots, 0), dtype=np.float32),
        stored=_f32(stored), slots=slots)


@dataclass(frozen=True)
class ErrorModel:
    """Each record's error (its loss's slope) as a function of its logit ``l``.

    The error is ``sig * sigmoid(l) + const + lin * l`` (``[B]`` float32 arrays).
    """

    sig: np.ndarray
    const: np.ndarray
    lin: np.ndarray

    def at(self, logits: np.ndarray) -> np.ndarray:
        """The modelled errors at ``logits``."""
        return self.sig / (1.0 + np.exp(-logits)) + self.const + self.lin * logits


def fit_errors(slope: np.ndarray, curve: np.ndarray, at: np.ndarray,
               logistic: bool) -> ErrorModel:
    """The error model matching each record's loss slope and its derivative at ``at``.

    ``logistic``: ``c * (sigmoid(l) - t)`` (exact for cross entropy on a logit, where ``c``
    is the record's weight and ``t`` its label), where the fit exists; otherwise, and for
    every record when not ``logistic``, the tangent line (exact for an L2 loss).
    """
    at64 = at.astype(np.float64)
    sig = 0.5 * (1.0 + np.tanh(0.5 * at64))  # the sigmoid, without exp's overflow
    d = sig * (1.0 - sig)
    ok = logistic & (curve > 0) & (d > 1e-6)
    c = np.where(ok, curve / np.where(ok, d, 1.0), 0.0)
    line_const = slope - curve * at64
    return ErrorModel(
        sig=c.astype(np.float32),
        const=np.where(ok, slope - c * sig, line_const).astype(np.float32),
        lin=np.where(ok, 0.0, curve).astype(np.float32))


def _native_pass(pairs: ScanPairs, kind: int, per_record: bool, gain: float, eps: float,
                 base: np.ndarray, errors: ErrorModel) -> np.ndarray:
    lib = native_kernels.library()
    assert lib is not None
    width = pairs.jrow.shape[1]
    sums = np.zeros((pairs.slots, width), dtype=np.float64)
    squares = np.zeros((pairs.slots, width), dtype=np.float64)
    scratch = np.zeros(2 * width, dtype=np.float64)
    shift = np.zeros(len(base), dtype=np.float32)
    lib.odl_in_batch_scan(
        len(pairs.order), width, pairs.acc.shape[1], _ptr(pairs.order), _ptr(pairs.sample),
        _ptr(pairs.slot), _ptr(pairs.cols), _ptr(pairs.jrow), _ptr(pairs.weight), _ptr(pairs.rate),
        _ptr(pairs.acc), _ptr(pairs.stored), kind, int(per_record), gain, eps, _ptr(base),
        _ptr(errors.sig), _ptr(errors.const), _ptr(errors.lin), _ptr(sums), _ptr(squares),
        _ptr(scratch), _ptr(shift))
    return shift


def scan_pass(pairs: ScanPairs, kind: int, per_record: bool, gain: float, eps: float,
              base: np.ndarray, errors: ErrorModel) -> np.ndarray:
    """One pass over the records in order: the compiled one, else ``python_pass``.

    Arguments and result as ``python_pass``.
    """
    run = _native_pass if native_pass_available() else python_pass
    return run(pairs, kind, per_record, gain, eps, base, errors)


def python_pass(pairs: ScanPairs, kind: int, per_record: bool, gain: float, eps: float,
                base: np.ndarray, errors: ErrorModel) -> np.ndarray:
    """The pass of ``in_batch_scan.c`` one record at a time in Python (no C compiler).

    Args:
        pairs: the prepared pairs.
        kind: the table kind (a value of ``KINDS``).
        per_record: the per-record accumulator rule.
        gain: its largest gain.
        eps: the fused kernel's epsilon.
        base: ``[B]`` the unshifted logits.
        errors: the records' error model.

    Returns:
        The ``[B]`` shifts.
    """
    width = pairs.jrow.shape[1]
    sums = np.zeros((pairs.slots, width))
    squares = np.zeros((pairs.slots, width))
    shift = np.zeros(len(base), dtype=np.float32)
    order = pairs.order
    recs = pairs.sample[order]
    bounds = np.flatnonzero(np.diff(recs)) + 1
    for run in np.split(order, bounds) if len(order) else []:
        rec = int(pairs.sample[run[0]])
        slot = pairs.slot[run]
        s_rows, q_rows = sums[slot], squares[slot]
        jrow = pairs.jrow[run].astype(np.float64)
        if kind == KINDS["sgd"]:
            dot = (jrow * s_rows).sum(1)
        elif kind == KINDS["rowwise_adagrad"]:
            s2 = (s_rows * s_rows).sum(1)
            grow = s2 / gain ** 2 if per_record else s2
            if per_record:
                grow = np.maximum(grow, q_rows[:, 0])
            den = 1.0 / np.sqrt(pairs.acc[slot, 0] + grow / pairs.stored[slot] + eps * eps)
            dot = np.where(s2 > 0, (jrow * s_rows).sum(1) * den, 0.0)
        else:
            grow = s_rows * s_rows / gain ** 2 if per_record else s_rows * s_rows
            if per_record:
                grow = np.maximum(grow, q_rows)
            den = 1.0 / np.sqrt(pairs.acc[slot] + grow + eps * eps)
            dot = np.where(s_rows != 0, jrow * s_rows * den, 0.0).sum(1)
        s = -float((pairs.rate[slot] * pairs.weight[run] * dot).sum())
        shift[rec] = s
        lgt = float(base[rec]) + s
        e = (float(errors.sig[rec]) / (1.0 + np.exp(-lgt)) + float(errors.const[rec])
             + float(errors.lin[rec]) * lgt)
        per_slot = np.zeros((pairs.slots, width))
        np.add.at(per_slot, slot, pairs.weight[run, None] * jrow)
        touched = np.unique(slot)
        g = e * per_slot[touched]
        sums[touched] += g
        if kind == KINDS["rowwise_adagrad"]:
            squares[touched, 0] += (g * g).sum(1)
        else:
            squares[touched] += g * g
    return shift


class InBatchScan:
    """Finds the shifts of the module docstring for one step.

    Args:
        kind: the table kernel (a key of ``KINDS``).
        per_record: ``per_record_adagrad`` is on.
        gain: ``per_record_adagrad_max_gain``.
        eps: the fused kernel's epsilon.
        logistic: the model's output is a logit under a cross-entropy-like loss (not a
            regression value): the records' errors are modelled as ``fit_errors`` does.
        exact: the model is exact for the loss (cross entropy on the logit, or L2 on a
            regression value): one pass, not checked.
    """

    def __init__(self, kind: str, per_record: bool, gain: float, eps: float,
                 logistic: bool = True, exact: bool = False) -> None:
        self.kind = KINDS[kind]
        self.per_record = bool(per_record) and kind != "sgd"
        self.gain = float(gain)
        self.eps = float(eps)
        self.logistic = bool(logistic)
        self.exact = bool(exact)
        self.passes = 0  # passes of the last shift (observability, tests)

    def shift(self, pairs: ScanPairs, logits: torch.Tensor,
              loss_at: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The ``[B]`` shifts of ``logits`` (module docstring); no gradient flows.

        ``solve`` with the slopes of ``loss_at``.

        Args:
            pairs: the step's prepared pairs.
            logits: ``[B]`` the step's logits at its starting state.
            loss_at: the step's loss at given ``[B]`` logits (the rest of the forward fixed).

        Returns:
            Tensor ``[B]`` like ``logits``.
        """
        def slopes_at(at: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            return loss_slopes(loss_at, torch.from_numpy(at).to(logits.device, logits.dtype))

        base = _f32(logits)
        slope, curve = loss_slopes(loss_at, logits)
        shift = self.solve(pairs, base, slope, curve, slopes_at)
        return torch.from_numpy(shift).to(logits.device, logits.dtype)

    def solve(self, pairs: ScanPairs, base: np.ndarray, slope: np.ndarray, curve: np.ndarray,
              slopes_at: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
        """The ``[B]`` shifts of the records' logits ``base`` (module docstring).

        Each pass models every record's error by ``fit_errors`` at the last pass's logits
        (the unshifted ones first) and runs the records in order. The shifts are final when
        the model matched the loss's true slope at the logits the pass reached (within
        ``TOLERANCE`` of the largest slope), or at once where the model is ``exact``.

        Args:
            pairs: the step's prepared pairs.
            base: ``[B]`` float32, the records' logits at the step's start.
            slope: ``[B]`` each record's loss slope at ``base``.
            curve: ``[B]`` its derivative in the record's own logit.
            slopes_at: the records' ``(slope, curve)`` at given ``[B]`` logits (called
                between passes only, never where the model is ``exact``).

        Returns:
            ``[B]`` float32.
        """
        at = base
        shift = np.zeros_like(base)
        self.passes = 0
        while self.passes < ITERATIONS:
            errors = fit_errors(slope, curve, at, self.logistic)
            shift = scan_pass(pairs, self.kind, self.per_record, self.gain, self.eps, base,
                              errors)
            self.passes += 1
            if self.exact:
                break
            at = base + shift
            slope, curve = slopes_at(at)
            scale = float(np.abs(slope).max(initial=0.0))
            if float(np.abs(errors.at(at) - slope).max(initial=0.0)) <= TOLERANCE * scale:
                break
        return shift


def error_model_is_exact(model_config: pipeline_pb2.EasyRecModel) -> bool:
    """Whether ``fit_errors`` is exact for the model's loss.

    It is where every term is cross entropy on the logit (CLASSIFICATION,
    CROSS_ENTROPY_LOSS), or every term is L2_LOSS (a regression).
    """
    types = {t.loss_type for t in model_config.losses} or {model_config.loss_type}
    logistic = {pipeline_pb2.CLASSIFICATION, pipeline_pb2.CROSS_ENTROPY_LOSS}
    return types <= logistic or types == {pipeline_pb2.L2_LOSS}


def loss_slopes(loss_at: Callable[[torch.Tensor], torch.Tensor],
                at: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Each record's loss slope and its derivative in its own logit, at ``at``."""
    return loss_and_slopes(loss_at, at)[1:]


def loss_and_slopes(loss_at: Callable[[torch.Tensor], torch.Tensor],
                    at: torch.Tensor) -> tuple[float, np.ndarray, np.ndarray]:
    """The loss at ``at`` and ``loss_slopes`` there, from one evaluation of the loss."""
    with torch.enable_grad():
        leaf = at.detach().requires_grad_(True)
        value = loss_at(leaf)
        (slope,) = torch.autograd.grad(value, leaf, create_graph=True)
        if slope.requires_grad:
            (curve,) = torch.autograd.grad(slope.sum(), leaf, allow_unused=True)
        else:  # a slope that does not depend on the logit (a linear loss)
            curve = None
    if curve is None:
        curve = torch.zeros_like(slope)
    return float(value.detach()), _f32(slope), _f32(curve)
