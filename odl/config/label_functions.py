"""EasyRec's ``user_define_fn``: a function that makes a label field's values from its column.

EasyRec applies it to label fields only, a batch at a time, before the labels are used:

* ``user_define_fn_path`` names a Python file (local or ``oss://``; a relative path is read
  beside the config file, else from the working directory, as EasyRec's scripts run from
  their repository) and ``user_define_fn`` a function in it, called on the column as a numpy
  array of the field's ``input_type`` (EasyRec's ``tf.py_func`` form, which needs
  ``user_define_fn_res_type``); its result, one value per record, is read as that type;
* without a path, ``user_define_fn`` names a TensorFlow function EasyRec applies to the
  label tensor; odl runs the element-wise ones in :data:`TF_FUNCTIONS` with numpy.

Here the record parser (``odl.features.record_parser``) calls the function on the batch's
parsed label column (the records still accepted), then checks the result as it checks any
label (0 / 1, a class index, a finite number). A record whose result is not a finite number,
or that makes the function raise (when the batch's call raises, the records are retried one
by one), is rejected as ``bad_label``; a function returning the wrong shape rejects its
batch's records the same way. The file runs as Python in every process that parses records
(the trainer, its input process, each rank), as EasyRec runs it.

Refused by field at validation: a function on a field that is not a label, or on a STRING
label; a file that cannot be read or does not define the function; a path without
``user_define_fn_res_type``; a TensorFlow function odl does not run.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from odl.config.config_error import ConfigError
from odl.protos import pipeline_pb2

logger = logging.getLogger(__name__)

__all__ = ["TF_FUNCTIONS", "LabelFunction", "label_functions", "resolve_label_function_paths",
           "validate_label_functions"]

_FT = pipeline_pb2.DatasetConfig.FieldType
_NUMPY_TYPES = {_FT.INT32: np.int32, _FT.INT64: np.int64, _FT.FLOAT: np.float32,
                _FT.DOUBLE: np.float64, _FT.BOOL: np.bool_}

# EasyRec's TensorFlow label functions odl runs (element-wise, the same results in numpy)
TF_FUNCTIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    **{f"{prefix}{name}": fn for prefix in ("tf.math.", "tf.")
       for name, fn in (("log1p", np.log1p), ("log", np.log), ("exp", np.exp),
                        ("sqrt", np.sqrt), ("abs", np.abs), ("sign", np.sign),
                        ("round", np.round), ("floor", np.floor), ("ceil", np.ceil),
                        ("square", np.square),
                        ("sigmoid", lambda x: 1.0 / (1.0 + np.exp(-x))))},
}


@dataclass
class LabelFunction:
    """One label field's function (module docstring).

    Attributes:
        field: the label field.
        function: the callable (numpy array in, one value per record out).
        in_type: numpy type of the column passed in (the field's ``input_type``).
        out_type: numpy type its result is read as.
    """

    field: str
    function: Callable[[np.ndarray], np.ndarray]
    in_type: type
    out_type: type
    _warned: bool = field(default=False, repr=False)

    def apply(self, values: np.ndarray, ok: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The function's values of the ``ok`` rows of a parsed label column.

        Args:
            values: the column (``float64``, one value per record).
            ok: the records still accepted (the function sees only those).

        Returns:
            ``(float64 values, failed mask)``: rows not ``ok`` keep their value; a row
            whose result is missing or not finite is marked failed.
        """
        out = values.astype(np.float64, copy=True)
        failed = np.zeros(values.shape[0], dtype=bool)
        rows = np.flatnonzero(ok)
        if rows.size == 0:
            return out, failed
        column = values[rows]
        if np.issubdtype(self.in_type, np.integer):  # an integer field holds integers
            whole = column == np.floor(column)
            failed[rows[~whole]] = True
            rows, column = rows[whole], column[whole]
        try:
            result = self._call(column.astype(self.in_type))
        except Exception as exc:  # noqa: BLE001 - the user's code: isolate the records
            self._warn(exc)
            result = np.full(rows.size, np.nan)
            for k in range(rows.size):
                try:
                    result[k] = self._call(column[k:k + 1].astype(self.in_type))[0]
                except Exception:  # noqa: BLE001
                    pass
        bad = ~np.isfinite(result)
        failed[rows[bad]] = True
        out[rows] = np.where(bad, 0.0, result)
        return out, failed

    def _call(self, column: np.ndarray) -> np.ndarray:
        result = np.asarray(self.function(column))
        if result.shape != column.shape:
            raise ValueError(f"returned shape {result.shape} for a column of {column.shape}")
        result = result.astype(np.float64)
        if self.out_type is np.bool_:
            return np.where(np.isnan(result), np.nan, result != 0)
        if np.issubdtype(self.out_type, np.integer):  # read as an integer: truncated
            return np.where(np.isfinite(result), np.trunc(result), np.nan)
        return result.astype(self.out_type).astype(np.float64)

    def _warn(self, exc: Exception) -> None:
        if not self._warned:
            self._warned = True
            logger.warning("user_define_fn of label %r raised on a batch (%s: %s); its records "
                           "are retried one by one and those it fails on are rejected "
                           "(bad_label)", self.field, type(exc).__name__, exc)


def resolve_label_function_paths(config: pipeline_pb2.EasyRecConfig, config_path: str) -> None:
    """Makes each relative ``user_define_fn_path`` absolute, in place (module docstring).

    Args:
        config: the config loaded from ``config_path``.
        config_path: the config file (local or ``oss://``), or "" (a config from text).
    """
    for f in config.data_config.input_fields:
        path = f.user_define_fn_path
        if not path or "://" in path or os.path.isabs(path):
            continue
        if config_path and "://" in config_path:
            f.user_define_fn_path = f"{config_path.rsplit('/', 1)[0]}/{path}"
            continue
        beside = (os.path.join(os.path.dirname(os.path.abspath(config_path)), path)
                  if config_path else "")
        f.user_define_fn_path = beside if beside and os.path.exists(beside) else (
            os.path.abspath(path))


def validate_label_functions(dc: pipeline_pb2.DatasetConfig) -> None:
    """Checks every ``user_define_fn`` and loads its file (module docstring).

    Raises:
        ConfigError: naming the field.
    """
    label_functions(dc)


def label_functions(dc: pipeline_pb2.DatasetConfig) -> dict[str, LabelFunction]:
    """Label field -> its function, loaded (module docstring).

    Raises:
        ConfigError: naming the field.
    """
    out: dict[str, LabelFunction] = {}
    labels = set(dc.label_fields)
    for i, f in enumerate(dc.input_fields):
        where = f"data_config.input_fields[{i}]"
        if not f.user_define_fn:
            for name in ("user_define_fn_path", "user_define_fn_res_type"):
                if f.HasField(name):
                    raise ConfigError(f"{where}.{name}", "needs user_define_fn")
            continue
        if f.input_name not in labels:
            raise ConfigError(f"{where}.user_define_fn",
                              f"{f.input_name!r} is not a label field; EasyRec applies "
                              "user_define_fn to labels only")
        if f.input_type not in _NUMPY_TYPES:
            raise ConfigError(f"{where}.user_define_fn",
                              f"label {f.input_name!r} is a STRING field; odl applies "
                              "user_define_fn to numeric labels")
        in_type = _NUMPY_TYPES[f.input_type]
        if not f.user_define_fn_path:
            if f.user_define_fn not in TF_FUNCTIONS:
                raise ConfigError(f"{where}.user_define_fn", (
                    f"{f.user_define_fn!r}: without user_define_fn_path EasyRec applies a "
                    "TensorFlow function; odl runs "
                    f"{', '.join(n for n in TF_FUNCTIONS if n.startswith('tf.math.'))}"))
            out[f.input_name] = LabelFunction(f.input_name, TF_FUNCTIONS[f.user_define_fn],
                                              in_type, np.float64)
            continue
        if not f.HasField("user_define_fn_res_type"):
            raise ConfigError(f"{where}.user_define_fn_res_type", (
                "required with user_define_fn_path (EasyRec calls the file's function through "
                "tf.py_func; without a result type it applies it as a TensorFlow function, "
                "which odl does not run)"))
        if f.user_define_fn_res_type not in _NUMPY_TYPES:
            raise ConfigError(f"{where}.user_define_fn_res_type",
                              "a label is a number: INT32, INT64, FLOAT, DOUBLE or BOOL")
        function = _load(f.user_define_fn_path, f.user_define_fn, f"{where}.user_define_fn_path")
        out[f.input_name] = LabelFunction(f.input_name, function, in_type,
                                          _NUMPY_TYPES[f.user_define_fn_res_type])
    return out


def _load(path: str, name: str, where: str) -> Callable[[np.ndarray], np.ndarray]:
    """The function ``name`` of the Python file at ``path`` (run as a module of its own)."""
    from odl.storage import file_store  # the storage layer (oss2) only where a file is read

    try:
        source = file_store.read_text(path)
    except OSError as exc:
        raise ConfigError(where, f"cannot read {path}: {exc}") from None
    namespace: dict = {"__name__": f"odl_user_define_fn_{abs(hash(path))}", "__file__": path}
    try:
        exec(compile(source, path, "exec"), namespace)  # noqa: S102 - the user's own file
    except Exception as exc:  # noqa: BLE001 - any error of the user's file is a config error
        raise ConfigError(where, f"{path} fails to load: {type(exc).__name__}: {exc}") from None
    function = namespace.get(name)
    if not callable(function):
        raise ConfigError(where, f"{path} defines no function {name!r}")
    return function
