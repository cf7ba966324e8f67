"""EasyRec's ``--edit_config_json``: changing a loaded config by dotted paths.

A JSON object maps paths into the config to new values (:func:`apply_edit_config_json`).
A path is dotted field names, each optionally followed by one selector:

* ``[i]`` an index (negative counts from the end), ``[a:b]`` a slice;
* ``[lhs OP value]`` with OP one of ``= != >= <= > <``: every element whose ``lhs`` (a path
  relative to the element) compares true, e.g. ``feature_configs[input_names[0]=C1]``.

Values replace scalars and repeated fields, merge into messages (a JSON object, or protobuf
text), and update maps key by key; JSON ``null`` clears a field or removes a map key. Enum
fields take the value's name or number. ``feature_configs`` paths also reach
``feature_config.features`` when the config uses that form.

Errors are :class:`~odl.config.config_error.ConfigError` naming the path as written in the
edit; values under a secret name are never echoed (:mod:`odl.config.config_redaction`).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from typing import Any, Union

from google.protobuf import message_factory, text_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from odl.config import limits
from odl.config.config_error import ConfigError
from odl.config.config_fields import (
    describe_value,
    is_map_field,
    join_path,
    short_name,
    suggest_field,
)
from odl.config.config_redaction import mask_echoed_values, may_hold_secret
from odl.config.easyrec_compat import (
    EASYREC_NO_EFFECT_FIELDS,
    EASYREC_NOT_IMPLEMENTED_FIELDS,
    EASYREC_NOT_IMPLEMENTED_VALUES,
    not_implemented_field_message,
)
from odl.protos import pipeline_pb2

logger = logging.getLogger(__name__)

__all__ = ["apply_edit_config_json"]


def apply_edit_config_json(
    config: Message, edits: Union[str, dict[str, Any]]
) -> None:
    """Apply EasyRec-style ``--edit_config_json`` edits in place.

    Keys are dotted paths into the config, values the new values::

        {"train_config.num_steps": 10}
        {"kafka_train_input.server": "h:9092"}
        {"feature_configs[0].boundaries": [1, 2, 3]}          # repeated: replaced
        {"model_config.feature_groups[1].feature_names": ["a", "b"]}
        {"train_config": {"num_steps": 10}}                    # nested: merged
        {"feature_configs[input_names[0]=C1].embedding_dim": 8}  # selector
        {"feature_configs[:3].embedding_dim": 8}               # slice
        {"data_config.input_fields[0].input_type": "STRING"}   # enum by name
        {"kafka_train_input.kafka_config": {"security.protocol": "SASL_SSL"}}  # map: updated

    Selectors ``[lhs OP value]`` (OP one of ``= != >= <= > <``) select every element whose
    ``lhs`` (a path relative to the element) compares true; ``feature_configs`` paths also
    reach ``feature_config.features`` when the config uses that form. A JSON ``null`` clears a
    field (or removes a map key). A message may also be given as protobuf text.

    Args:
        config: the config (any message; normally ``EasyRecConfig``).
        edits: JSON text or an already decoded dict.

    Raises:
        ConfigError: malformed JSON, unknown path, index out of range, or a value of the wrong
            type; ``field`` is the path as written in the edit.

    """
    if isinstance(edits, (str, bytes)):
        try:
            edits = json.loads(edits)
        except RecursionError:
            raise ConfigError("edit_config_json",
                              f"nested too deeply (at most {limits.MAX_EDIT_JSON_DEPTH} "
                              "levels)") from None
        except ValueError as e:
            raise ConfigError("edit_config_json", f"not valid JSON: {e}") from None
    if not isinstance(edits, dict):
        raise ConfigError("edit_config_json",
                          f"expected a JSON object of path: value, got {type(edits).__name__}")
    depth = _json_depth(edits)
    if depth > limits.MAX_EDIT_JSON_DEPTH:
        raise ConfigError("edit_config_json",
                          f"nested {depth} levels deep (at most {limits.MAX_EDIT_JSON_DEPTH})")
    try:
        for key, value in edits.items():
            _apply_edit(config, str(key), value, "")
    except RecursionError:
        raise ConfigError("edit_config_json", "nested too deeply") from None


def _json_depth(value: Any) -> int:
    """Nesting depth of a decoded JSON value (a scalar is 0), computed without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            items = list(item.values())
        elif isinstance(item, list):
            items = item
        else:
            deepest = max(deepest, depth)
            continue
        deepest = max(deepest, depth + 1)
        if deepest > limits.MAX_EDIT_JSON_DEPTH:
            return deepest
        stack.extend((sub, depth + 1) for sub in items)
    return deepest


def _apply_edit(msg: Message, key: str, value: Any, prefix: str) -> None:
    full = join_path(prefix, key)
    segments = _split_path(key, full)
    if (segments and segments[0][0] == "feature_configs"
            and isinstance(msg, pipeline_pb2.EasyRecConfig)
            and not msg.feature_configs and msg.feature_config.features):
        segments = [("feature_config", []), ("features", segments[0][1]), *segments[1:]]
    try:
        targets = list(_resolve(msg, segments, full))
    except _NoEffect as skipped:
        harmful = str(value).strip().lower() in skipped.harmful
        if harmful:
            raise ConfigError(full, f"{skipped.name}: {value} would change the trained model, "
                                    f"and odl does not implement it: {skipped.why}") from None
        logger.warning("config field %s has no effect in odl and is ignored: %s", full,
                       skipped.why)
        return
    for parent, fd, index in targets:
        _set_value(parent, fd, index, value, full)


class _NoEffect(Exception):
    """An edit of a field that changes nothing in odl (``EASYREC_NO_EFFECT_FIELDS``)."""

    def __init__(self, name: str, why: str, harmful: frozenset[str]) -> None:
        super().__init__(name)
        self.name, self.why, self.harmful = name, why, harmful


def _split_path(key: str, full: str) -> list[tuple[str, list[str]]]:
    """Split ``a.b[0].c[x[1]=y]`` into ``[("a", []), ("b", ["0"]), ("c", ["x[1]=y"])]``."""
    segments: list[tuple[str, list[str]]] = []
    i, n = 0, len(key)
    while i < n:
        m = re.match(r"[A-Za-z_][A-Za-z0-9_]*", key[i:])
        if not m:
            raise ConfigError(full, f"malformed path at {key[i:]!r}")
        name = m.group()
        i += len(name)
        selectors: list[str] = []
        while i < n and key[i] == "[":
            depth, j = 0, i
            while j < n:
                if key[j] == "[":
                    depth += 1
                elif key[j] == "]":
                    depth -= 1
                    if depth == 0:
                        break
                j += 1
            if j >= n:
                raise ConfigError(full, "unbalanced '[' in path")
            selectors.append(key[i + 1:j].strip())
            i = j + 1
        segments.append((name, selectors))
        if i < n:
            if key[i] != ".":
                raise ConfigError(full, f"malformed path at {key[i:]!r}")
            i += 1
            if i == n:
                raise ConfigError(full, "path ends with '.'")
    if not segments:
        raise ConfigError(full or "edit_config_json", "empty path")
    return segments


def _field(msg: Message, name: str, full: str) -> FieldDescriptor:
    desc = msg.DESCRIPTOR
    fd = desc.fields_by_name.get(name)
    if fd is not None:
        return fd
    short = short_name(desc.full_name)
    if name in EASYREC_NO_EFFECT_FIELDS.get(short, {}):
        raise _NoEffect(name, *EASYREC_NO_EFFECT_FIELDS[short][name])
    if name in EASYREC_NOT_IMPLEMENTED_FIELDS.get(short, ()):
        raise ConfigError(full, not_implemented_field_message(short, name))
    raise ConfigError(full, f"unknown field {name!r} in {short}{suggest_field(name, desc)}")


def _resolve(
    msg: Message, segments: list[tuple[str, list[str]]], full: str
) -> list[tuple[Message, FieldDescriptor, int | None]]:
    current = [msg]
    for pos, (name, selectors) in enumerate(segments):
        last = pos == len(segments) - 1
        targets: list[tuple[Message, FieldDescriptor, int | None]] = []
        for parent in current:
            fd = _field(parent, name, full)
            if selectors:
                if not fd.is_repeated or is_map_field(fd):
                    raise ConfigError(full, f"{name} is not a repeated field; it takes no [...]")
                if len(selectors) > 1:
                    raise ConfigError(full, f"{name}: only one [...] is supported")
                container = getattr(parent, name)
                for idx in _select(container, fd, selectors[0], full):
                    targets.append((parent, fd, idx))
            else:
                targets.append((parent, fd, None))
        if last:
            return targets
        nxt: list[Message] = []
        for parent, fd, idx in targets:
            if fd.cpp_type != FieldDescriptor.CPPTYPE_MESSAGE or is_map_field(fd):
                raise ConfigError(full, f"{fd.name} is not a message; cannot go into it")
            if idx is None and fd.is_repeated:
                raise ConfigError(full, f"{fd.name} is repeated; select elements with [i], "
                                        f"[a:b] or [field=value]")
            nxt.append(getattr(parent, fd.name) if idx is None else getattr(parent, fd.name)[idx])
        current = nxt
    return []


_SELECTOR_OPS = (">=", "<=", "!=", "=", ">", "<")


def _select(container: Any, fd: FieldDescriptor, selector: str, full: str) -> list[int]:
    size = len(container)
    if re.fullmatch(r"-?\d+", selector):
        idx = int(selector)
        if idx < 0:
            idx += size
        if not 0 <= idx < size:
            raise ConfigError(full, f"index {selector} out of range ({fd.name} has {size} "
                                    f"element{'s' if size != 1 else ''})")
        return [idx]
    m = re.fullmatch(r"(-?\d*)\s*:\s*(-?\d*)", selector)
    if m:
        lo = int(m.group(1)) if m.group(1) else None
        hi = int(m.group(2)) if m.group(2) else None
        return list(range(size))[lo:hi]
    op_pos, op = _find_operator(selector)
    if op_pos < 0:
        raise ConfigError(full, f"bad selector [{selector}]: expected an index, a slice or "
                                f"field=value")
    if fd.cpp_type != FieldDescriptor.CPPTYPE_MESSAGE:
        raise ConfigError(full, f"selector [{selector}] needs a repeated message field")
    lhs = selector[:op_pos].strip()
    rhs = selector[op_pos + len(op):].strip()
    if len(rhs) >= 2 and rhs[0] == rhs[-1] and rhs[0] in "'\"":
        rhs = rhs[1:-1]
    lhs_segments = _split_path(lhs, full)
    chosen = []
    for i, element in enumerate(container):
        values = list(_read_values(element, lhs_segments, full))
        if any(_compare(v, op, rhs) for v in values):
            chosen.append(i)
    if not chosen:
        raise ConfigError(full, f"selector [{selector}] matched no element of {fd.name}")
    return chosen


def _find_operator(selector: str) -> tuple[int, str]:
    depth = 0
    for i, ch in enumerate(selector):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif depth == 0:
            for op in _SELECTOR_OPS:
                if selector.startswith(op, i):
                    return i, op
    return -1, ""


def _read_values(msg: Message, segments: list[tuple[str, list[str]]], full: str) -> Iterator[Any]:
    """Values at a relative path (for selectors); repeated fields yield every element."""
    name, selectors = segments[0]
    fd = _field(msg, name, full)
    value = getattr(msg, name)
    if isinstance(msg, pipeline_pb2.FeatureConfig) and name == "feature_name" and not value \
            and msg.input_names:
        value = msg.input_names[0]  # the effective name, as feature_configs() reports it
    if fd.is_repeated and not is_map_field(fd):
        items = list(value)
        if selectors:
            sel = selectors[0]
            if re.fullmatch(r"-?\d+", sel):
                idx = int(sel)
                items = [items[idx]] if -len(items) <= idx < len(items) else []
            else:
                items = [items[i] for i in _select(value, fd, sel, full)]
    else:
        items = [value]
    for item in items:
        if len(segments) > 1:
            if not isinstance(item, Message):
                raise ConfigError(full, f"{name} is not a message")
            yield from _read_values(item, segments[1:], full)
        elif fd.enum_type is not None:
            yield fd.enum_type.values_by_number[item].name if item in \
                fd.enum_type.values_by_number else item
        else:
            yield item


def _compare(value: Any, op: str, rhs: str) -> bool:
    if isinstance(value, bool):
        left: Any = value
        right: Any = rhs.lower() in ("true", "1")
    elif isinstance(value, (int, float)):
        try:
            left, right = float(value), float(rhs)
        except ValueError:
            return False
    else:
        left, right = str(value), rhs
    if op == "=":
        return left == right
    if op == "!=":
        return left != right
    try:
        return {">": left > right, "<": left < right, ">=": left >= right,
                "<=": left <= right}[op]
    except TypeError:
        return False


def _set_value(parent: Message, fd: FieldDescriptor, index: int | None, value: Any,
               full: str) -> None:
    name = fd.name
    if is_map_field(fd):
        if value is None:
            parent.ClearField(name)
            return
        if not isinstance(value, dict):
            raise ConfigError(full, "expected an object of key: value, got a "
                                    f"{type(value).__name__}")  # the value may be a secret
        mapping = getattr(parent, name)
        value_fd = fd.message_type.fields_by_name["value"]
        for k, v in value.items():
            if v is None:
                mapping.pop(str(k), None)
            elif value_fd.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
                _merge_message(mapping[str(k)], v, f"{full}.{k}")
            else:
                mapping[str(k)] = _convert_scalar(value_fd, v, f"{full}.{k}", secret_ok=True)
        return
    is_msg = fd.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE
    if fd.is_repeated and index is None:
        if value is None:
            parent.ClearField(name)
            return
        items = value if isinstance(value, list) else [value]
        if is_msg:
            if not isinstance(value, list):
                raise ConfigError(full, f"expected a list of objects, got {describe_value(value)}")
            cls = message_factory.GetMessageClass(fd.message_type)
            new_msgs = []
            for i, item in enumerate(items):
                sub = cls()
                _merge_message(sub, item, f"{full}[{i}]")
                new_msgs.append(sub)
            parent.ClearField(name)
            getattr(parent, name).extend(new_msgs)
        else:
            converted = [_convert_scalar(fd, v, f"{full}[{i}]") for i, v in enumerate(items)]
            parent.ClearField(name)
            getattr(parent, name).extend(converted)
        return
    if is_msg:
        target = getattr(parent, name) if index is None else getattr(parent, name)[index]
        if value is None:
            if index is not None:
                raise ConfigError(full, "null cannot remove one element; give the whole list")
            parent.ClearField(name)
            return
        _merge_message(target, value, full)
        return
    if value is None:
        if index is not None:
            raise ConfigError(full, "null cannot remove one element; give the whole list")
        parent.ClearField(name)
        return
    if isinstance(value, (list, dict)):
        raise ConfigError(full, f"expected a single value, got {describe_value(value)}")
    converted = _convert_scalar(fd, value, full)
    if index is None:
        setattr(parent, name, converted)
    else:
        getattr(parent, name)[index] = converted


def _merge_message(target: Message, value: Any, full: str) -> None:
    if isinstance(value, dict):
        target.SetInParent()
        for k, v in value.items():
            _apply_edit(target, str(k), v, full)
    elif isinstance(value, str):
        replacement = type(target)()
        try:
            text_format.Parse(value, replacement)
        except text_format.ParseError as e:
            detail = mask_echoed_values(str(e)) if may_hold_secret(full, value) else str(e)
            raise ConfigError(full, f"cannot parse message text: {detail}") from None
        target.CopyFrom(replacement)
    else:
        raise ConfigError(full, f"expected an object, got {describe_value(value)}")


_INT_RANGES = {
    FieldDescriptor.CPPTYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.CPPTYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.CPPTYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.CPPTYPE_UINT64: (0, 2**64 - 1),
}


def _convert_scalar(fd: FieldDescriptor, value: Any, full: str, secret_ok: bool = False) -> Any:
    ct = fd.cpp_type
    got = "a value" if secret_ok else describe_value(value)
    if ct in _INT_RANGES:
        out: Any = None
        if isinstance(value, bool):
            out = None
        elif isinstance(value, int):
            out = value
        elif isinstance(value, float) and value.is_integer():
            out = int(value)
        elif isinstance(value, str) and re.fullmatch(r"\s*[-+]?\d+\s*", value):
            out = int(value)
        if out is None:
            raise ConfigError(full, f"expected an integer, got {got}")
        lo, hi = _INT_RANGES[ct]
        if not lo <= out <= hi:
            raise ConfigError(full, f"value out of range [{lo}, {hi}]: {out}")
        return out
    if ct in (FieldDescriptor.CPPTYPE_FLOAT, FieldDescriptor.CPPTYPE_DOUBLE):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(full, f"expected a number, got {got}")
    if ct == FieldDescriptor.CPPTYPE_BOOL:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        raise ConfigError(full, f"expected true or false, got {got}")
    if ct == FieldDescriptor.CPPTYPE_ENUM:
        enum = fd.enum_type
        if isinstance(value, str) and value in enum.values_by_name:
            return enum.values_by_name[value].number
        if isinstance(value, int) and not isinstance(value, bool) and \
                value in enum.values_by_number:
            return value
        short = short_name(enum.full_name)
        if isinstance(value, str) and value in EASYREC_NOT_IMPLEMENTED_VALUES.get(short, ()):
            raise ConfigError(full, f"{value} is an EasyRec value that odl does not implement yet")
        names = [v.name for v in enum.values]
        raise ConfigError(full, f"expected one of {names}, got {got}")
    if ct == FieldDescriptor.CPPTYPE_STRING:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(full, f"expected a string, got {got}")
    raise ConfigError(full, f"cannot set a field of this type to {got}")

