"""Loading the pipeline config (``EasyRecConfig``): the file, its parse errors, the edits.

The config is protobuf text format with Alibaba EasyRec's field names (``protos/pipeline.proto``).
:func:`load_pipeline_config` reads a file, applies ``--edit_config_json``
(:mod:`odl.config.config_edit`) and ``--model_dir``, and refuses what odl does not implement
(:mod:`odl.config.easyrec_compat`). Cross-field checks are
:func:`odl.config.config_validation.validate_pipeline_config`'s.

Every problem is a :class:`~odl.config.config_error.ConfigError` naming the field by its
dotted path and the file position, e.g. ``invalid config field 'train_config.num_steps':
expected an integer, got "abc" (at p.config:12:14)``.
protobuf's parse errors name neither the field path nor, for a nested message, the enclosing
message; a small tokenizer over the text (:func:`_locate_path`) finds both. A parse error
never echoes the offending line, and shows ``***`` for a value that may be a secret.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Union

from google.protobuf import text_format

from odl.config.config_edit import apply_edit_config_json
from odl.config.config_error import ConfigError, raise_all
from odl.config.config_fields import (
    enum_value_names,
    is_map_field,
    join_path,
    message_descriptor,
    short_name,
    suggest_field,
)
from odl.config.config_forms import normalize_config_forms
from odl.config.config_redaction import REDACTED, mask_echoed_values, may_hold_secret
from odl.config.easyrec_compat import (
    EASYREC_NO_EFFECT_FIELDS,
    EASYREC_NOT_IMPLEMENTED_FIELDS,
    EASYREC_NOT_IMPLEMENTED_VALUES,
    check_implemented,
    infer_model_class,
    not_implemented_field_message,
    warn_unwritten_batch_norm,
)
from odl.config.feature_settings import resolve_vocab_files
from odl.config.label_functions import resolve_label_function_paths
from odl.config.rtp_fg_json import load_fg_json
from odl.config.vector_labels import normalize_vector_labels
from odl.protos import pipeline_pb2
from odl.storage import file_store
from odl.storage.oss_credentials import OssCredentialsError
from odl.storage.oss_store import StorageError
from odl.storage.storage_path import UnsupportedPathError, check_supported

logger = logging.getLogger(__name__)

__all__ = ["load_pipeline_config", "parse_pipeline_config_text"]


def load_pipeline_config(
    path: str,
    edit_config_json: Union[str, dict, None] = None,
    model_dir: str | None = None,
) -> pipeline_pb2.EasyRecConfig:
    """Read a pipeline config in protobuf text format.

    Steps: parse ``path``; apply ``edit_config_json`` (EasyRec's ``--edit_config_json``);
    override ``model_dir``; infer ``model_config.model_class`` ("DeepFM") when only the
    ``deepfm`` message is given (TorchEasyRec style); make a relative ``vocab_file``
    relative to ``path``'s directory; reject EasyRec values odl does not implement.
    Cross-field checks are :func:`validate_pipeline_config`'s job.

    Args:
        path: the config file, local or ``oss://bucket/key``.
        edit_config_json: JSON text or a dict of ``{"dotted.path": value}`` edits.
        model_dir: when given, replaces ``model_dir`` (like EasyRec's ``--model_dir``).

    Returns:
        The parsed config.

    Raises:
        ConfigError: the file is missing or unreadable, does not parse, uses a field odl does
            not know or implement, or an edit is invalid.

    """
    if not path:
        raise ConfigError("pipeline_config_path", "no pipeline config file given")
    try:
        check_supported(path)
        text = file_store.read_text(path)
    except FileNotFoundError:
        raise ConfigError("pipeline_config_path", f"file not found: {path}") from None
    except (OSError, UnicodeDecodeError, UnsupportedPathError, OssCredentialsError,
            StorageError) as e:
        raise ConfigError("pipeline_config_path", f"cannot read {path}: {e}") from None
    config = parse_pipeline_config_text(text, source=path)
    if edit_config_json is not None:
        apply_edit_config_json(config, edit_config_json)
    if model_dir:
        config.model_dir = model_dir
    infer_model_class(config)
    warn_unwritten_batch_norm(config)
    load_fg_json(config, path)
    resolve_label_function_paths(config, path)
    normalize_vector_labels(config)
    normalize_config_forms(config)
    resolve_vocab_files(config, path)
    check_implemented(config)
    logger.debug("loaded pipeline config %s", path)
    return config


_BARE_OFFSET_TIME = re.compile(r"(\boffset_time\s*:\s*)(\d+)(?=\s|$|[;,}#])", re.MULTILINE)


def parse_pipeline_config_text(text: str, source: str = "<text>") -> pipeline_pb2.EasyRecConfig:
    """Parse config text, turning protobuf's ParseError into a :class:`ConfigError`.

    Args:
        text: protobuf text format.
        source: name used in messages (the file path).

    Returns:
        The parsed config (not normalized, not validated).

    Raises:
        ConfigError: naming the field and the line:column of the problem.

    """
    # EasyRec's offset_time is a string; configs often give it as a bare number
    text = _BARE_OFFSET_TIME.sub(r'\1"\2"', text)
    errors: list[ConfigError] = []
    ignored: list[tuple[str, str]] = []
    duplicates: list[str] = []
    for _ in range(_MAX_PARSE_ERRORS):
        config = pipeline_pb2.EasyRecConfig()
        try:
            text_format.Parse(text, config)
            break
        except text_format.ParseError as e:
            error = _parse_error_to_config_error(e, text, source)
            earlier = _earlier_duplicate(e, text)
            if earlier is not None:  # EasyRec's loader (text_format.Merge): the last one wins
                duplicates.append(error.field)
                text = text[:earlier[0]] + re.sub(r"[^\n]", " ", text[earlier[0]:earlier[1]]) \
                    + text[earlier[1]:]
                continue
            field = _unknown_field(e)
            span = _field_span(text, e.GetLine(), e.GetColumn()) if field else None
            if span is None:  # not a field that can be cut out: parsing cannot go on
                errors.append(error)
                break
            msg_name, name = field
            why, harmful = EASYREC_NO_EFFECT_FIELDS.get(msg_name, {}).get(name, ("", None))
            value = _scalar_value(text, span).lower()
            if why and value not in (harmful or ()):
                ignored.append((error.field, why))
            elif why:
                at = re.search(r"\(at [^)]*\)$", error.message)
                where = f" {at.group()}" if at else ""
                errors.append(ConfigError(
                    error.field, f"{name}: {value} would change the trained model, and odl "
                                 f"does not implement it: {why}{where}"))
            else:
                errors.append(error)
            # blank the field out (lines and columns of what follows stay where they were)
            text = text[:span[0]] + re.sub(r"[^\n]", " ", text[span[0]:span[1]]) + text[span[1]:]
        except RecursionError:
            raise ConfigError("pipeline_config_path",
                              f"{source} is nested too deeply to parse") from None
    raise_all(errors)
    for path, why in ignored:
        logger.warning("config field %s has no effect in odl and is ignored: %s", path, why)
    for path in duplicates:
        logger.warning("config field %s is written more than once; its last value is used, as "
                       "EasyRec's loader takes it", path)
    return config


_MAX_PARSE_ERRORS = 200


def _earlier_duplicate(err: text_format.ParseError, text: str) -> tuple[int, int] | None:
    """Span of the earlier occurrence of a singular field written twice in one message.

    protobuf's ``Parse`` refuses the second occurrence ("should not have multiple"); EasyRec
    loads configs with ``Merge``, where the last one wins, so the earlier one is cut out.
    None for any other error, or where the earlier one cannot be found.
    """
    m = re.search(r'should not have multiple "(\w+)" fields', str(err))
    if m is None or not err.GetLine():
        return None
    lines = text.split("\n")
    pos = sum(len(ln) + 1 for ln in lines[: err.GetLine() - 1]) + max(err.GetColumn() - 1, 0)
    # per open block: field name -> its starts (the error points into the second one)
    names: list[dict[str, list[int]]] = [{}]
    for tok in _TOKEN_RE.finditer(text):
        if tok.start() >= pos:
            break
        kind, value = tok.lastgroup, tok.group()
        if kind == "punct" and value in "{<":
            names.append({})
        elif kind == "punct" and value in "}>" and len(names) > 1:
            names.pop()
        elif kind == "word" and text[tok.end():].lstrip()[:1] in (":", "{", "<"):
            names[-1].setdefault(value, []).append(tok.start())
    starts = names[-1].get(m.group(1), [])
    if starts and text.count("\n", 0, starts[-1]) + 1 == err.GetLine():
        starts = starts[:-1]  # (the error points past the second one's name)
    if not starts:
        return None
    start = starts[-1]
    line = text.count("\n", 0, start) + 1
    col = start - (text.rfind("\n", 0, start) + 1) + 1
    return _field_span(text, line, col)


def _unknown_field(err: text_format.ParseError) -> tuple[str, str] | None:
    """``(message short name, field)`` of a "has no field named" error, else None."""
    m = re.search(r'Message type "([\w.]+)" has no field named "(\w+)"', str(err))
    return (short_name(m.group(1)), m.group(2)) if m else None


def _field_span(text: str, line: int, col: int) -> tuple[int, int] | None:
    """Character span of the field whose name starts at ``line``:``col`` (1-based).

    The span holds the name and its value (a scalar, a list or a message block); None when it
    cannot be delimited.
    """
    if not line:
        return None
    lines = text.split("\n")
    start = sum(len(ln) + 1 for ln in lines[: line - 1]) + max(col - 1, 0)
    tokens = _TOKEN_RE.finditer(text, start)
    depth, seen_name, seen_colon = 0, False, False
    for m in tokens:
        kind, tok = m.lastgroup, m.group()
        if kind in ("ws", "comment"):
            continue
        if not seen_name:
            if kind != "word":
                return None
            seen_name = True
            continue
        if depth == 0 and not seen_colon and tok == ":":
            seen_colon = True
            continue
        if tok in "{<[":
            depth += 1
            continue
        if tok in "}>]":
            depth -= 1
            if depth < 0:
                return None
            if depth == 0:
                return start, m.end()
            continue
        if depth == 0:
            if not seen_colon:
                return None
            end = m.end()
            for more in _TOKEN_RE.finditer(text, end):  # adjacent strings concatenate
                if more.lastgroup == "ws":
                    continue
                if more.lastgroup == "str" and kind == "str":
                    end = more.end()
                    continue
                break
            return start, end
    return None


def _scalar_value(text: str, span: tuple[int, int]) -> str:
    """The value of a ``name: value`` span ("" for a message or list)."""
    body = text[span[0]:span[1]]
    _, _, value = body.partition(":")
    value = value.strip()
    return "" if value[:1] in ("{", "<", "[") else value.strip("'\"")


def _parse_error_to_config_error(
    err: text_format.ParseError, text: str, source: str
) -> ConfigError:
    line, col = err.GetLine(), err.GetColumn()
    raw = str(err)
    lines = text.split("\n")
    detail = re.sub(r"^\d+:\d+ : ", "", raw)
    if line and 0 < line <= len(lines):
        quoted = f"'{lines[line - 1]}': "
        if detail.startswith(quoted):  # protobuf echoes the line; it may hold a secret
            detail = detail[len(quoted):]
    detail = re.sub(r"^'.*?': ", "", detail)
    where = f"{source}:{line}:{col}" if line else source
    prefix, last_name = _locate_path(text, line, col) if line else ("", "")
    line_text = lines[line - 1] if line and 0 < line <= len(lines) else ""
    # protobuf echoes the offending token, which may be a secret value: not on such lines.
    sensitive = may_hold_secret(join_path(prefix, last_name), line_text)

    m = re.search(r'Message type "([\w.]+)" has no field named "(\w+)"', detail)
    if m:
        msg_name, field = short_name(m.group(1)), m.group(2)
        path = join_path(prefix, field)
        if field in EASYREC_NOT_IMPLEMENTED_FIELDS.get(msg_name, ()):
            return ConfigError(path, f"{not_implemented_field_message(msg_name, field)} "
                                     f"(at {where})")
        hint = suggest_field(field, message_descriptor(msg_name))
        return ConfigError(path, f"unknown field {field!r} in {msg_name}{hint} (at {where})")

    m = re.search(r'multiple "(\w+)" fields|Field "(\w+)" is specified along with', detail)
    if m:
        last_name = m.group(1) or m.group(2)
    path = join_path(prefix, last_name) or "<config>"
    m = re.search(r'Enum type "([\w.]+)" has no value named (\w+)', detail)
    if m:
        enum_name, value = short_name(m.group(1)), m.group(2)
        if value in EASYREC_NOT_IMPLEMENTED_VALUES.get(enum_name, ()):
            return ConfigError(path, f"{value} is an EasyRec value that odl does not implement "
                                     f"yet (at {where})")
        allowed = enum_value_names(enum_name)
        return ConfigError(path, f"unknown value {value!r}, expected one of {allowed} "
                                 f"(at {where})")
    m = re.match(r"Couldn't parse (integer|float|double|boolean|bool)\w*: (.*)$", detail)
    if m:
        kind = {"integer": "an integer", "boolean": "true or false", "bool": "true or false"}
        wanted = kind.get(m.group(1), "a number")
        got = m.group(2)
        if not got.startswith('"'):
            got = f'"{got}"'
        if sensitive:
            got = REDACTED
        return ConfigError(path, f"expected {wanted}, got {got} (at {where})")
    if sensitive:
        detail = mask_echoed_values(detail)
    return ConfigError(path, f"{detail[:1].lower()}{detail[1:]} (at {where})")


_TOKEN_RE = re.compile(
    r"""(?P<ws>\s+)|(?P<comment>\#[^\n]*)
      |(?P<str>"(?:[^"\\\n]|\\.)*"?|'(?:[^'\\\n]|\\.)*'?)
      |(?P<punct>[{}<>:\[\],;])
      |(?P<word>[^\s{}<>:\[\],;"'\#]+)""",
    re.X,
)


def _locate_path(text: str, line: int, col: int) -> tuple[str, str]:
    """Find the enclosing message path and the last field name before a text position.

    A small tokenizer over protobuf text format, used only to name the field in parse errors.

    Returns:
        ``(path of the enclosing message, e.g. "feature_configs[3]", last field name seen)``.

    """
    lines = text.split("\n")
    offset = sum(len(ln) + 1 for ln in lines[: line - 1]) + max(col - 1, 0)
    root: dict[str, Any] = {"desc": pipeline_pb2.EasyRecConfig.DESCRIPTOR, "path": "",
                            "counts": {}, "ret": "name"}
    stack = [root]
    state, last_name, list_depth = "name", "", 0

    def push(ret: str) -> None:
        frame = stack[-1]
        desc = frame["desc"]
        fd = desc.fields_by_name.get(last_name) if desc is not None else None
        seg = last_name
        if fd is not None and fd.is_repeated and not is_map_field(fd):
            idx = frame["counts"].get(last_name, 0)
            frame["counts"][last_name] = idx + 1
            seg = f"{last_name}[{idx}]"
        sub = fd.message_type if fd is not None else None
        stack.append({"desc": sub, "path": join_path(frame["path"], seg), "counts": {}, "ret": ret,
                      "name": last_name})

    for m in _TOKEN_RE.finditer(text):
        if m.start() >= offset:
            break
        kind, tok = m.lastgroup, m.group()
        if kind in ("ws", "comment"):
            continue
        if state == "name":
            if kind == "word":
                last_name, state = tok, "after_name"
            elif tok in "}>" and len(stack) > 1:
                frame = stack.pop()
                last_name, state = frame["name"], frame["ret"]
        elif state == "after_name":
            if tok == ":":
                state = "value"
            elif tok in "{<":
                push("name")
                state = "name"
            else:
                state = "name"
        elif state == "value":
            if tok in "{<":
                push("name")
                state = "name"
            elif tok == "[":
                state, list_depth = "list", 1
            else:
                state = "name"
        elif state == "list":
            if tok in "{<":
                push("list")
                state = "name"
            elif tok == "[":
                list_depth += 1
            elif tok == "]":
                list_depth -= 1
                if list_depth == 0:
                    state = "name"
    return stack[-1]["path"], last_name

