"""Validation of a pipeline config's ``train_config``.

:func:`validate_train_config` checks, with a :class:`~odl.config.config_error.ConfigError`
naming the first offending field: one optimizer form (EasyRec's ``optimizer_config`` or
TorchEasyRec's ``sparse_optimizer`` + ``dense_optimizer``) with valid rates, schedules and
optimizer settings; at most one gradient clipping form; stop and logging intervals;
``dead_line``; the wide learning rate multiplier, ``per_record_adagrad`` and
``in_batch_learning`` (with the model and tables they need); the fine-tune var map; and
``incr_save_config`` (where versions go, chunk size within :data:`MIN_DELTA_CHUNK_BYTES` and
:data:`MAX_DELTA_CHUNK_BYTES`).
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

from odl.config import limits
from odl.config.config_error import ConfigError
from odl.config.field_formats import parse_dead_line
from odl.config.in_batch_settings import IN_BATCH_OFF, in_batch_mode, in_batch_refusal
from odl.config.optimizer_support import (
    PER_RECORD_TABLE_KINDS,
    dense_ema_configured,
    optimizer_choices,
    table_kernel_kind,
)
from odl.protos import pipeline_pb2

__all__ = [
    "MAX_DELTA_CHUNK_BYTES",
    "MIN_DELTA_CHUNK_BYTES",
    "validate_train_config",
]

# Largest delta chunk: the delta topic is created with max.message.bytes = 16 MiB.
MAX_DELTA_CHUNK_BYTES = 16 << 20
MIN_DELTA_CHUNK_BYTES = 4096


def validate_train_config(config: pipeline_pb2.EasyRecConfig) -> None:
    """Checks ``train_config``; raises on the first problem.

    Args:
        config: a loaded config (its model settings are read too, for in-batch learning).

    Raises:
        ConfigError: naming the offending field.
    """
    tc = config.train_config
    where = "train_config"
    opts = list(tc.optimizer_config)
    tzrec = tc.HasField("sparse_optimizer") or tc.HasField("dense_optimizer")
    if opts and tzrec:
        raise ConfigError(f"{where}.optimizer_config",
                          "give either optimizer_config (EasyRec) or sparse_optimizer + "
                          "dense_optimizer (TorchEasyRec), not both")
    if opts:
        if len(opts) > 2:
            raise ConfigError(f"{where}.optimizer_config",
                              f"1 entry (all parameters) or 2 (embeddings, dense) are supported, "
                              f"got {len(opts)}")
        for i, opt in enumerate(opts):
            _validate_easyrec_optimizer(opt, f"{where}.optimizer_config[{i}]")
        multiplier = "embedding_learning_rate_multiplier"
        if len(opts) > 1 and opts[1].HasField(multiplier):
            raise ConfigError(f"{where}.optimizer_config[1].{multiplier}",
                              "EasyRec reads it from the first optimizer_config (the "
                              "embeddings' entry) only, where it would take effect; move it "
                              "there or remove it")
        m = opts[0].embedding_learning_rate_multiplier
        if not 0 < m <= limits.MAX_TABLE_GRADIENT_MULTIPLIER:
            raise ConfigError(f"{where}.optimizer_config[0].{multiplier}",
                              f"must be > 0 and at most "
                              f"{limits.MAX_TABLE_GRADIENT_MULTIPLIER:g}, got {m:g}")
    elif tzrec:
        for name in ("sparse_optimizer", "dense_optimizer"):
            if not tc.HasField(name):
                raise ConfigError(f"{where}.{name}",
                                  "sparse_optimizer and dense_optimizer go together")
            _validate_tzrec_optimizer(getattr(tc, name), f"{where}.{name}")
        _validate_part_optimizers(tc.dense_optimizer, f"{where}.dense_optimizer")
    else:
        raise ConfigError(f"{where}.optimizer_config",
                          "no optimizer configured: set optimizer_config (EasyRec) or "
                          "sparse_optimizer + dense_optimizer (TorchEasyRec)")
    _validate_grad_clipping(tc, where)
    _validate_dense_ema(config)
    if tc.HasField("num_steps") and tc.num_steps == 0:
        raise ConfigError(f"{where}.num_steps", "must be > 0 (leave it unset to run until "
                                                "stopped)")
    if tc.log_step_count_steps <= 0:
        raise ConfigError(f"{where}.log_step_count_steps", "must be > 0")
    if tc.keep_checkpoint_max > 100000:
        raise ConfigError(f"{where}.keep_checkpoint_max", "unreasonably large (0 keeps all)")
    if not tc.stop_signal_poll_secs > 0 or not math.isfinite(tc.stop_signal_poll_secs):
        raise ConfigError(f"{where}.stop_signal_poll_secs", "must be > 0")
    if tc.metrics_window_samples <= 0:
        raise ConfigError(f"{where}.metrics_window_samples", "must be > 0")
    if tc.metrics_window_samples > limits.MAX_METRICS_WINDOW_SAMPLES:
        raise ConfigError(f"{where}.metrics_window_samples",
                          f"{tc.metrics_window_samples:,} is above the limit of "
                          f"{limits.MAX_METRICS_WINDOW_SAMPLES:,}")
    parse_dead_line(tc.dead_line)
    _validate_in_batch_learning(config)
    if tc.fine_tune_ckpt_var_map and not os.path.isfile(tc.fine_tune_ckpt_var_map):
        raise ConfigError(f"{where}.fine_tune_ckpt_var_map",
                          f"file not found: {tc.fine_tune_ckpt_var_map}")
    if tc.fine_tune_ckpt_var_map and not tc.fine_tune_checkpoint:
        raise ConfigError(f"{where}.fine_tune_ckpt_var_map",
                          "set fine_tune_checkpoint too (the map renames its parameters)")
    if tc.HasField("incr_save_config"):
        _validate_incr_save(tc.incr_save_config, f"{where}.incr_save_config")


def _validate_in_batch_learning(config: pipeline_pb2.EasyRecConfig) -> None:
    """The wide rate, ``per_record_adagrad``'s settings, ``in_batch_learning``'s model."""
    tc = config.train_config
    m = tc.wide_learning_rate_multiplier
    if not (0 < m <= limits.MAX_WIDE_LR_MULTIPLIER) or not math.isfinite(m):
        raise ConfigError("train_config.wide_learning_rate_multiplier",
                          f"must be > 0 and at most {limits.MAX_WIDE_LR_MULTIPLIER:g}, got {m:g}")
    gain = tc.per_record_adagrad_max_gain
    if not (1 <= gain <= limits.MAX_PER_RECORD_GAIN):
        raise ConfigError("train_config.per_record_adagrad_max_gain",
                          f"must be at least 1 and at most {limits.MAX_PER_RECORD_GAIN:g}, "
                          f"got {gain:g}")
    if tc.per_record_adagrad:
        field = "train_config.per_record_adagrad"
        sparse, _ = optimizer_choices(tc)
        if table_kernel_kind(sparse.kind) not in PER_RECORD_TABLE_KINDS:
            raise ConfigError(field, f"needs (row-wise) Adagrad tables; the tables train with "
                                     f"{sparse.kind}")
        if in_batch_mode(config) == IN_BATCH_OFF:
            raise ConfigError(field, "needs in-batch learning (without it the larger steps "
                                     "overshoot; docs/training.md#per-record-adagrad)")
    if tc.in_batch_learning:  # written true: the config must allow it
        refusal = in_batch_refusal(config)
        if refusal is not None:
            raise ConfigError(*refusal)


def _validate_incr_save(isc: Any, where: str) -> None:
    if not (isc.sparse_save_steps or isc.dense_save_steps or isc.sparse_save_secs
            or isc.dense_save_secs):
        raise ConfigError(f"{where}.sparse_save_steps",
                          "set at least one of sparse_save_steps, dense_save_steps, "
                          "sparse_save_secs, dense_save_secs (> 0)")
    kind = isc.WhichOneof("incr_update")
    if kind is None:
        raise ConfigError(f"{where}.kafka", "choose where versions go: kafka { server topic } "
                                            "or fs { incr_save_dir }")
    if kind == "kafka":
        if not isc.kafka.server:
            raise ConfigError(f"{where}.kafka.server", "required (host:port list)")
        if not isc.kafka.topic:
            raise ConfigError(f"{where}.kafka.topic", "required")
    elif not isc.fs.incr_save_dir:
        raise ConfigError(f"{where}.fs.incr_save_dir", "must not be empty")
    if not MIN_DELTA_CHUNK_BYTES <= isc.max_chunk_bytes <= MAX_DELTA_CHUNK_BYTES:
        raise ConfigError(f"{where}.max_chunk_bytes",
                          f"must be in [{MIN_DELTA_CHUNK_BYTES}, {MAX_DELTA_CHUNK_BYTES}]")


def _validate_easyrec_optimizer(opt: Any, where: str) -> None:
    kind = opt.WhichOneof("optimizer")
    if kind is None:
        raise ConfigError(where, "choose an optimizer (sgd_optimizer, momentum_optimizer, "
                                 "adagrad_optimizer, adam_optimizer, adamw_optimizer, "
                                 "lazy_adam_optimizer, ftrl_optimizer, rms_prop_optimizer, "
                                 "momentumw_optimizer, adam_async_optimizer, "
                                 "adam_asyncw_optimizer or adagrad_decay_optimizer)")
    inner = getattr(opt, kind)
    _validate_easyrec_lr(inner.learning_rate, f"{where}.{kind}.learning_rate")
    w = f"{where}.{kind}"
    fields = inner.DESCRIPTOR.fields_by_name
    if "beta1" in fields:
        _check_betas(inner, w)
    if "weight_decay" in fields and not 0 <= inner.weight_decay < 1:
        raise ConfigError(f"{w}.weight_decay", "must be in [0, 1) (the decay per step)")
    if "momentum_optimizer_value" in fields and not 0 <= inner.momentum_optimizer_value < 1:
        raise ConfigError(f"{w}.momentum_optimizer_value", "must be in [0, 1)")
    if kind == "rms_prop_optimizer":
        if not 0 <= inner.decay < 1:
            raise ConfigError(f"{w}.decay", "must be in [0, 1)")
        if not inner.epsilon > 0:
            raise ConfigError(f"{w}.epsilon", "must be > 0")
    if kind == "adagrad_optimizer" and inner.initial_accumulator_value < 0:
        raise ConfigError(f"{w}.initial_accumulator_value", "must be >= 0")
    if kind == "adagrad_decay_optimizer":
        if not inner.initial_accumulator_value > 0:
            raise ConfigError(f"{w}.initial_accumulator_value", "must be > 0 (DeepRec's rule: "
                                                                "the floor a decay stops at)")
        if not inner.accumulator_decay_step > 0:
            raise ConfigError(f"{w}.accumulator_decay_step", "must be > 0 (global steps)")
        if not 0 < inner.accumulator_decay_rate < 1:
            raise ConfigError(f"{w}.accumulator_decay_rate", "must be in (0, 1)")
    if kind == "ftrl_optimizer":
        if not inner.learning_rate_power <= 0:
            raise ConfigError(f"{w}.learning_rate_power", "must be <= 0")
        if not inner.initial_accumulator_value > 0:
            raise ConfigError(f"{w}.initial_accumulator_value", "must be > 0")
        for name in ("l1_reg", "l2_reg", "l2_shrinkage_reg"):
            if not getattr(inner, name) >= 0:
                raise ConfigError(f"{w}.{name}", "must be >= 0")


def _validate_easyrec_lr(lr: Any, lr_where: str) -> None:
    which = lr.WhichOneof("learning_rate")
    if which == "constant_learning_rate":
        if not lr.constant_learning_rate.learning_rate > 0:
            raise ConfigError(f"{lr_where}.constant_learning_rate.learning_rate", "must be > 0")
    elif which == "exponential_decay_learning_rate":
        e = lr.exponential_decay_learning_rate
        ew = f"{lr_where}.exponential_decay_learning_rate"
        if not e.initial_learning_rate > 0:
            raise ConfigError(f"{ew}.initial_learning_rate", "must be > 0")
        if e.decay_steps <= 0:
            raise ConfigError(f"{ew}.decay_steps", "must be > 0")
        if not 0 < e.decay_factor <= 1:
            raise ConfigError(f"{ew}.decay_factor", "must be in (0, 1]")
        if e.min_learning_rate < 0:
            raise ConfigError(f"{ew}.min_learning_rate", "must be >= 0")
        if e.burnin_learning_rate < 0:
            raise ConfigError(f"{ew}.burnin_learning_rate", "must be >= 0")
        if e.burnin_learning_rate > 0 and e.burnin_steps == 0:
            raise ConfigError(f"{ew}.burnin_steps", "must be > 0 when burnin_learning_rate "
                                                    "is set")
    elif which == "cosine_decay_learning_rate":
        c = lr.cosine_decay_learning_rate
        cw = f"{lr_where}.cosine_decay_learning_rate"
        if not c.learning_rate_base > 0:
            raise ConfigError(f"{cw}.learning_rate_base", "must be > 0")
        if not 0 <= c.warmup_learning_rate <= c.learning_rate_base:
            raise ConfigError(f"{cw}.warmup_learning_rate",
                              "must be in [0, learning_rate_base]")
        if not c.total_steps > c.warmup_steps + c.hold_base_rate_steps:
            raise ConfigError(f"{cw}.total_steps",
                              f"must be > warmup_steps + hold_base_rate_steps "
                              f"({c.warmup_steps + c.hold_base_rate_steps}), got "
                              f"{c.total_steps}")
    elif which == "manual_step_learning_rate":
        m = lr.manual_step_learning_rate
        mw = f"{lr_where}.manual_step_learning_rate"
        if not m.initial_learning_rate >= 0:
            raise ConfigError(f"{mw}.initial_learning_rate", "must be >= 0")
        _check_manual_steps([x.step for x in m.schedule], [x.learning_rate for x in m.schedule],
                            lambda i: f"{mw}.schedule[{i}].step",
                            lambda i: f"{mw}.schedule[{i}].learning_rate")
    elif which == "transformer_learning_rate":
        t = lr.transformer_learning_rate
        tw = f"{lr_where}.transformer_learning_rate"
        for name in ("learning_rate_base", "hidden_size", "warmup_steps", "step_scaling_rate"):
            if not getattr(t, name) > 0:
                raise ConfigError(f"{tw}.{name}", "required, > 0")
    elif which == "poly_decay_learning_rate":
        p = lr.poly_decay_learning_rate
        pw = f"{lr_where}.poly_decay_learning_rate"
        if not p.learning_rate_base > 0:
            raise ConfigError(f"{pw}.learning_rate_base", "required, > 0")
        if p.total_steps <= 0:
            raise ConfigError(f"{pw}.total_steps", "required, > 0")
        if not p.power > 0:
            raise ConfigError(f"{pw}.power", "required, > 0 (1: linear)")
        if not 0 <= p.end_learning_rate:
            raise ConfigError(f"{pw}.end_learning_rate", "must be >= 0")


def _validate_tzrec_optimizer(opt: Any, where: str) -> None:
    kind = opt.WhichOneof("optimizer")
    if kind is None:
        raise ConfigError(where, "choose an optimizer (e.g. adagrad_optimizer { lr: 0.05 })")
    inner = getattr(opt, kind)
    w = f"{where}.{kind}"
    if not inner.lr > 0:
        raise ConfigError(f"{w}.lr", "must be > 0")
    fields = inner.DESCRIPTOR.fields_by_name
    if "beta1" in fields:
        _check_betas(inner, w)
    for name in ("weight_decay", "initial_accumulator_value", "dampening"):
        if name in fields and not getattr(inner, name) >= 0:
            raise ConfigError(f"{w}.{name}", "must be >= 0")
    if "eps" in fields and not inner.eps > 0:
        raise ConfigError(f"{w}.eps", "must be > 0")
    if "momentum" in fields and not 0 <= inner.momentum < 1:
        raise ConfigError(f"{w}.momentum", "must be in [0, 1)")
    if "nesterov" in fields and inner.nesterov and (inner.momentum == 0
                                                    or inner.dampening != 0):
        raise ConfigError(f"{w}.nesterov", "needs momentum > 0 and dampening 0")
    for name in ("rho", "alpha"):
        if name in fields and not 0 <= getattr(inner, name) < 1:
            raise ConfigError(f"{w}.{name}", "must be in [0, 1)")
    if "gradient_clipping" in fields and inner.gradient_clipping:
        if not where.endswith("sparse_optimizer"):
            raise ConfigError(f"{w}.gradient_clipping",
                              "clips the tables' gradients (a sparse_optimizer field); clip "
                              "the dense parameters' with train_config.grad_clipping")
        if not inner.max_gradient > 0:
            raise ConfigError(f"{w}.max_gradient", "must be > 0 with gradient_clipping")
    which = opt.WhichOneof("learning_rate")
    if which == "exponential_decay_learning_rate":
        e = opt.exponential_decay_learning_rate
        ew = f"{where}.exponential_decay_learning_rate"
        size = "decay_size" if e.HasField("decay_size") else "decay_steps"
        if getattr(e, size) <= 0:
            raise ConfigError(f"{ew}.{size}", "must be > 0")
        factor = ("decay_rate" if e.HasField("decay_rate") and not e.HasField("decay_factor")
                  else "decay_factor")
        if not 0 < getattr(e, factor) <= 1:
            raise ConfigError(f"{ew}.{factor}", "must be in (0, 1]")
        if e.min_learning_rate < 0:
            raise ConfigError(f"{ew}.min_learning_rate", "must be >= 0")
        _check_tzrec_warmup(e, ew)
    elif which == "cosine_annealing_learning_rate":
        c = opt.cosine_annealing_learning_rate
        cw = f"{where}.cosine_annealing_learning_rate"
        if c.T_max <= 0:
            raise ConfigError(f"{cw}.T_max", "required, > 0 (steps)")
        if c.min_learning_rate < 0:
            raise ConfigError(f"{cw}.min_learning_rate", "must be >= 0")
        _check_tzrec_warmup(c, cw)
    elif which == "cosine_annealing_warm_restarts_learning_rate":
        c = opt.cosine_annealing_warm_restarts_learning_rate
        cw = f"{where}.cosine_annealing_warm_restarts_learning_rate"
        if c.T_0 <= 0:
            raise ConfigError(f"{cw}.T_0", "required, > 0 (steps)")
        if c.T_mult < 1:
            raise ConfigError(f"{cw}.T_mult", "must be >= 1")
        if c.min_learning_rate < 0:
            raise ConfigError(f"{cw}.min_learning_rate", "must be >= 0")
        _check_tzrec_warmup(c, cw)
    elif which == "manual_step_learning_rate":
        m = opt.manual_step_learning_rate
        mw = f"{where}.manual_step_learning_rate"
        if len(m.schedule_sizes) != len(m.learning_rates):
            raise ConfigError(f"{mw}.learning_rates",
                              f"give one rate per schedule size ({len(m.schedule_sizes)} "
                              f"sizes, {len(m.learning_rates)} rates)")
        _check_manual_steps(list(m.schedule_sizes), list(m.learning_rates),
                            lambda i: f"{mw}.schedule_sizes", lambda i: f"{mw}.learning_rates")
        if m.by_epoch:
            raise ConfigError(f"{mw}.by_epoch", "schedules by epoch are not implemented (a "
                                                "stream has no epochs): give sizes in steps")


def _validate_dense_ema(config: pipeline_pb2.EasyRecConfig) -> None:
    """TorchEasyRec's dense EMA: a decay in [0, 1]; ``use_dense_ema: true`` needs one."""
    tc = config.train_config
    configured = dense_ema_configured(tc)
    if configured and not 0 <= tc.dense_optimizer.ema.decay <= 1:
        raise ConfigError("train_config.dense_optimizer.ema.decay", "must be in [0, 1]")
    for section in ("eval_config", "export_config"):
        msg = getattr(config, section)
        if msg.HasField("use_dense_ema") and msg.use_dense_ema and not configured:
            raise ConfigError(f"{section}.use_dense_ema", "there is no dense EMA to use: set "
                                                          "train_config.dense_optimizer.ema")


def _validate_part_optimizers(dense: Any, where: str) -> None:
    """TorchEasyRec's ``part_optimizers``: an optimizer each, a pattern that compiles."""
    for i, part in enumerate(dense.part_optimizers):
        pw = f"{where}.part_optimizers[{i}]"
        _validate_tzrec_optimizer(part, pw)
        if not part.regex_pattern:
            raise ConfigError(f"{pw}.regex_pattern", "required: a regular expression matched "
                                                     "in full against the dense parameters' "
                                                     "names")
        try:
            re.compile(part.regex_pattern)
        except re.error as err:
            raise ConfigError(f"{pw}.regex_pattern", f"not a regular expression: {err}") \
                from None


def _check_manual_steps(steps: list[int], rates: list[float], step_field: Any,
                        rate_field: Any) -> None:
    """Manual steps: at least one, steps > 0 and increasing, rates >= 0.

    ``step_field(i)`` / ``rate_field(i)`` name the i-th entry's fields.
    """
    if not steps:
        raise ConfigError(step_field(0), "give at least one step to switch the rate at")
    for i, (step, rate) in enumerate(zip(steps, rates, strict=True)):
        if step <= 0 or (i and step <= steps[i - 1]):
            raise ConfigError(step_field(i), f"steps must be > 0 and increasing, got "
                                             f"{list(steps)}")
        if not rate >= 0:
            raise ConfigError(rate_field(i), f"rates must be >= 0, got {rate:g}")


def _check_tzrec_warmup(msg: Any, where: str) -> None:
    if msg.by_epoch:
        raise ConfigError(f"{where}.by_epoch", "schedules by epoch are not implemented (a "
                                               "stream has no epochs): give sizes in steps")
    if msg.warmup_learning_rate < 0:
        raise ConfigError(f"{where}.warmup_learning_rate", "must be >= 0")


def _validate_grad_clipping(tc: Any, where: str) -> None:
    if not tc.gradient_clipping_by_norm >= 0 or not math.isfinite(tc.gradient_clipping_by_norm):
        raise ConfigError(f"{where}.gradient_clipping_by_norm", "must be >= 0 (0: no clipping)")
    if not tc.HasField("grad_clipping"):
        return
    gc = tc.grad_clipping
    gw = f"{where}.grad_clipping"
    kind = gc.clipping_type.strip().lower()
    if kind not in ("norm", "value", "none"):
        raise ConfigError(f"{gw}.clipping_type", f"expected norm, value or none, got "
                                                 f"{gc.clipping_type!r}")
    if kind != "none" and tc.gradient_clipping_by_norm > 0:
        raise ConfigError(f"{gw}", "give gradient_clipping_by_norm (EasyRec) or grad_clipping "
                                   "(TorchEasyRec), not both")
    if not gc.max_gradient > 0 or not math.isfinite(gc.max_gradient):
        raise ConfigError(f"{gw}.max_gradient", "must be > 0")
    if not gc.norm_type > 0:
        raise ConfigError(f"{gw}.norm_type", "must be > 0 (2.0: L2, inf: max)")


def _check_betas(inner: Any, where: str) -> None:
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(inner, name) < 1:
            raise ConfigError(f"{where}.{name}", "must be in [0, 1)")
