"""TorchEasyRec's dense EMA: a moving average of the dense parameters, evaluated and served.

``train_config.dense_optimizer.ema { decay }`` keeps, beside the dense parameters (every
parameter of the model's dense part, those of ``part_optimizers`` included; not its buffers
and not the tables), their exponential moving average: after every dense step
``avg = decay * avg + (1 - decay) * param``, the first step copying the parameters (torch's
``AveragedModel`` with ``get_ema_multi_avg_fn``, as TorchEasyRec's ``DenseEMA``). Training
reads the live parameters; where the average is used follows TorchEasyRec's
``use_dense_ema``:

* ``eval_config.use_dense_ema`` (unset: on with ``ema``): the evaluation beside training
  (``odl.train.stream_evaluation``) predicts with the average swapped in;
* ``export_config.use_dense_ema`` (unset: on with ``ema``): what serving receives, the dense
  variables of every published version (``TrainModule.served_dense_parameters``) and of every
  exported base (``odl.export.exporter``, from the checkpoint's ``dense_ema``), is the average.

Before the first dense step nothing is averaged and the parameters stand for the average (a
warm-started model serves its parameters). The average is checkpointed (``"dense_ema"``:
name -> tensor, with ``"__n_averaged__"``) and restored with the parameters; a checkpoint
without one starts it from the restored parameters. Every rank keeps the same average (the
dense parameters are the same on every rank). After a recovery from the delta topic, whose
dense variables were the average, the parameters and the average both start from it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from odl.config.optimizer_support import dense_ema_configured
from odl.protos import pipeline_pb2

logger = logging.getLogger(__name__)

__all__ = ["N_AVERAGED", "DenseEma", "build_dense_ema"]

N_AVERAGED = "__n_averaged__"


class DenseEma:
    """The moving average of named dense parameters (module docstring).

    Args:
        named_parameters: name (``dense.*``) -> live parameter.
        decay: the average's decay, in [0, 1].
    """

    def __init__(self, named_parameters: Mapping[str, torch.nn.Parameter], decay: float) -> None:
        self.decay = float(decay)
        self._params = dict(named_parameters)
        self._avg = {n: p.detach().clone() for n, p in self._params.items()}
        self.n_averaged = 0

    @torch.no_grad()
    def update(self) -> None:
        """Takes the live parameters into the average (after a dense step)."""
        avg, live = list(self._avg.values()), [p.detach() for p in self._params.values()]
        if self.n_averaged == 0:
            torch._foreach_copy_(avg, live)
        else:
            torch._foreach_lerp_(avg, live, 1.0 - self.decay)
        self.n_averaged += 1

    def averages(self) -> dict[str, torch.Tensor]:
        """Name -> the average (live tensors; do not modify).

        Before the first update (nothing averaged yet: a fresh or warm-started model), the
        parameters themselves.
        """
        if self.n_averaged == 0:
            return {n: p.detach() for n, p in self._params.items()}
        return dict(self._avg)

    @torch.no_grad()
    def restart_from_parameters(self, keep_averaging: bool = False) -> None:
        """The average becomes the live parameters.

        Args:
            keep_averaging: the next updates average into it (the parameters were set from
                a published average); else the next update copies the parameters again.
        """
        for n, p in self._params.items():
            self._avg[n].copy_(p.detach())
        self.n_averaged = max(1, self.n_averaged) if keep_averaging else 0

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """The average in the live parameters for the ``with`` block, then swapped back.

        Before the first update (nothing averaged) the parameters stay.
        """
        if self.n_averaged == 0:
            yield
            return
        with torch.no_grad():
            for n, p in self._params.items():
                tmp = p.detach().clone()
                p.copy_(self._avg[n])
                self._avg[n].copy_(tmp)
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in self._params.items():
                    tmp = p.detach().clone()
                    p.copy_(self._avg[n])
                    self._avg[n].copy_(tmp)

    def state_dict(self) -> dict[str, Any]:
        """Name -> CPU copy of the average, and ``N_AVERAGED``."""
        out: dict[str, Any] = {n: t.detach().to("cpu", copy=True) for n, t in self._avg.items()}
        out[N_AVERAGED] = torch.tensor(self.n_averaged, dtype=torch.int64)
        return out

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        """Restores the average; without one (or of other parameters) it restarts.

        Args:
            state: :meth:`state_dict`'s form, or None (a checkpoint written without ``ema``).
        """
        if state is None or set(state) - {N_AVERAGED} != set(self._avg) or any(
                tuple(state[n].shape) != tuple(t.shape) for n, t in self._avg.items()):
            if state is not None:
                logger.warning("the checkpoint's dense EMA is of other parameters: the average "
                               "restarts from the restored parameters")
            self.restart_from_parameters()
            return
        for n, t in self._avg.items():
            t.copy_(torch.as_tensor(state[n]).to(t.device, t.dtype))
        self.n_averaged = int(state[N_AVERAGED])


def build_dense_ema(config: pipeline_pb2.EasyRecConfig, dense: torch.nn.Module
                    ) -> DenseEma | None:
    """The dense EMA of ``train_config.dense_optimizer.ema``, None without one.

    Args:
        config: the pipeline config.
        dense: the model's dense part (its parameters are averaged as ``dense.<name>``).
    """
    if not dense_ema_configured(config.train_config):
        return None
    return DenseEma({f"dense.{n}": p for n, p in dense.named_parameters()},
                    config.train_config.dense_optimizer.ema.decay)
