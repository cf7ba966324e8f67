"""What one training step returns (``TrainModule.train_step``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["StepOutput"]


@dataclass
class StepOutput:
    """Result of one training step.

    Attributes:
        probs: float64 predictions of the step's forward pass, i.e. made before the step's
            update (progressive validation), one per trained sample (``[B]`` unless samples
            were dropped).
        loss: the step's loss (including regularization); NaN when nothing was trained.
        dropped: ``int64`` indices (into the batch) of the samples left out because their
            prediction was not finite; they were not trained on.
    """

    probs: np.ndarray
    loss: float
    dropped: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))

    @property
    def trained(self) -> int:
        """Number of samples the step trained on."""
        return int(self.probs.shape[0])
