"""The unit of work handed from feature building to the model: one parsed, hashed batch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


@dataclass
class Batch:
    """A batch ready for the model.

    Attributes:
        sparse: ids per embedded feature; keys are feature names in the order of
            ``FeatureBuilder.sparse_feature_names``; values are int64 row indices already in
            ``[0, num_rows)`` of the feature's table.
        dense: float32 ``[B, num_dense]`` raw (un-bucketized) numeric features, in
            ``FeatureBuilder.dense_feature_names`` order (``[B, 0]`` when there are none).
        labels: float32 ``[B]`` binary labels; ``[B, n]`` with ``n`` label fields (columns in
            ``data_config.label_fields`` order; multi-task models).
        sample_ids: per-sample ids when ``data_config.sample_id_field`` is set.
        event_times: float64 unix seconds per sample when ``data_config.event_time_field`` is set.
        counts: float32 per-sample show / click counts of dynamic tables' ``show_field`` /
            ``click_field``, by field name (None when no table names one).
        group_keys: int64 per-sample GAUC group (a hash of the grouping column), or None.
        session_keys: int64 per-sample JRC_LOSS session (a hash of its column), or None.
        sample_weights: float32 per-sample loss weights (``data_config.sample_weight``), or
            None.
        label_vectors: float32 ``[B, dim]`` per vector label (``data_config.vector_labels``:
            distillation's soft labels), or None.
    """

    sparse: KeyedJaggedTensor
    dense: torch.Tensor
    labels: torch.Tensor
    sample_ids: Optional[list[str]] = None
    event_times: Optional[np.ndarray] = None
    extras: dict = field(default_factory=dict)
    counts: Optional[dict[str, np.ndarray]] = None
    group_keys: Optional[np.ndarray] = None
    session_keys: Optional[np.ndarray] = None
    sample_weights: Optional[np.ndarray] = None
    label_vectors: Optional[dict[str, np.ndarray]] = None

    @property
    def size(self) -> int:
        """Number of samples."""
        return int(self.labels.shape[0])

    def select(self, keep: torch.Tensor) -> Batch:
        """The samples where the boolean mask ``keep`` ``[B]`` is true, in order.

        Args:
            keep: boolean mask over the batch's samples (on the batch's device).

        Returns:
            A new batch with the kept samples only (ids, dense features, labels and the
            per-sample lists alike).
        """
        keep = keep.to(torch.bool)
        lengths = self.sparse.lengths()
        num_keys = len(self.sparse.keys())
        per_value = torch.repeat_interleave(keep.repeat(num_keys), lengths.to(torch.int64))
        weights = self.sparse.weights_or_none()
        sparse = KeyedJaggedTensor(
            keys=self.sparse.keys(),
            values=self.sparse.values()[per_value],
            lengths=lengths.view(num_keys, -1)[:, keep].reshape(-1),
            weights=weights[per_value] if weights is not None else None,
        )
        rows = keep.nonzero().flatten().cpu().numpy()
        return Batch(
            sparse=sparse,
            dense=self.dense[keep],
            labels=self.labels[keep],
            sample_ids=([self.sample_ids[i] for i in rows.tolist()]
                        if self.sample_ids is not None else None),
            event_times=self.event_times[rows] if self.event_times is not None else None,
            extras=self.extras,
            counts=({k: v[rows] for k, v in self.counts.items()}
                    if self.counts is not None else None),
            group_keys=self.group_keys[rows] if self.group_keys is not None else None,
            session_keys=self.session_keys[rows] if self.session_keys is not None else None,
            sample_weights=(self.sample_weights[rows] if self.sample_weights is not None
                            else None),
            label_vectors=({k: v[rows] for k, v in self.label_vectors.items()}
                           if self.label_vectors is not None else None),
        )

    def padded(self, size: int) -> Batch:
        """The model inputs of this batch followed by ``size - B`` padding samples.

        A padding sample has no ids in any feature, zero dense features and zero labels; it
        reads no table row. Ranks of one job pad their batches to a common size, as
        TorchRec's sharded lookup needs (``odl.train.distributed``); only the first ``B``
        samples' outputs are used. The per-sample lists (sample ids, times, ...) are not
        carried.

        Args:
            size: samples of the result (at least ``B``).

        Returns:
            A new batch of ``size`` samples (this one when ``size == B``).
        """
        pad = int(size) - self.size
        if pad < 0:
            raise ValueError(f"cannot pad a batch of {self.size} samples to {size}")
        if pad == 0:
            return self
        lengths = self.sparse.lengths()
        num_keys = len(self.sparse.keys())
        lengths = torch.cat([lengths.view(num_keys, -1),
                             lengths.new_zeros(num_keys, pad)], dim=1).reshape(-1)
        sparse = KeyedJaggedTensor(keys=self.sparse.keys(), values=self.sparse.values(),
                                   lengths=lengths, weights=self.sparse.weights_or_none())
        return Batch(
            sparse=sparse,
            dense=torch.cat([self.dense, self.dense.new_zeros(pad, self.dense.shape[1])]),
            labels=torch.cat([self.labels,
                              self.labels.new_zeros((pad, *self.labels.shape[1:]))]),
            extras=self.extras,
        )

    def to(self, device: torch.device, non_blocking: bool = True) -> Batch:
        """Returns the batch with its tensors on ``device``."""
        return Batch(
            sparse=self.sparse.to(device, non_blocking=non_blocking),
            dense=self.dense.to(device, non_blocking=non_blocking),
            labels=self.labels.to(device, non_blocking=non_blocking),
            sample_ids=self.sample_ids,
            event_times=self.event_times,
            extras=self.extras,
            counts=self.counts,
            group_keys=self.group_keys,
            session_keys=self.session_keys,
            sample_weights=self.sample_weights,
            label_vectors=self.label_vectors,
        )
