"""Naming and finding the fields of the pipeline config's protobuf messages.

Every config error names its field by a dotted path (``feature_configs[3].embedding_dim``);
the loader, the ``--edit_config_json`` editor and the validator build those paths, look up
message and enum descriptors by their short names (``DatasetConfig.InputType``, without the
``odl.protos.`` package) and suggest the closest field name for a misspelt one, all through
this module.
"""

from __future__ import annotations

import difflib
import json
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor

from odl.protos import pipeline_pb2

__all__ = [
    "PACKAGE_PREFIX",
    "describe_value",
    "enum_value_names",
    "is_map_field",
    "join_path",
    "message_descriptor",
    "short_name",
    "suggest_field",
]

# The protobuf package of pipeline.proto, left out of the names errors show.
PACKAGE_PREFIX = "odl.protos."


def short_name(full_name: str) -> str:
    """A descriptor's full name without the ``odl.protos.`` package.

    Args:
        full_name: e.g. ``odl.protos.DatasetConfig.Field``.

    Returns:
        e.g. ``DatasetConfig.Field``.
    """
    return full_name[len(PACKAGE_PREFIX):] if full_name.startswith(PACKAGE_PREFIX) else full_name


def message_descriptor(short_name: str) -> Descriptor | None:
    """The descriptor of a message of ``pipeline.proto`` by its short name.

    Args:
        short_name: e.g. ``TrainConfig`` or ``DatasetConfig.Field``.

    Returns:
        The descriptor, or None when there is no such message.
    """
    desc: Any = pipeline_pb2.DESCRIPTOR
    parts = short_name.split(".")
    found = desc.message_types_by_name.get(parts[0])
    for part in parts[1:]:
        if found is None:
            return None
        found = found.nested_types_by_name.get(part)
    return found


def enum_value_names(short_name: str) -> list[str]:
    """The value names of an enum of ``pipeline.proto``.

    Args:
        short_name: e.g. ``LossType`` or ``DatasetConfig.InputType``.

    Returns:
        The names in declaration order; empty when there is no such enum.
    """
    parts = short_name.split(".")
    if len(parts) == 1:
        enum = pipeline_pb2.DESCRIPTOR.enum_types_by_name.get(parts[0])
    else:
        msg = message_descriptor(".".join(parts[:-1]))
        enum = msg.enum_types_by_name.get(parts[-1]) if msg else None
    return [v.name for v in enum.values] if enum else []


def suggest_field(name: str, desc: Descriptor | None) -> str:
    """A ``" (did you mean 'x'?)"`` hint for a misspelt field name.

    Args:
        name: the unknown field name.
        desc: the message it was looked up in.

    Returns:
        The hint, or ``""`` when no field name is close enough.
    """
    if desc is None:
        return ""
    close = difflib.get_close_matches(name, list(desc.fields_by_name), n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


def join_path(prefix: str, name: str) -> str:
    """Appends a field name to a dotted path.

    Args:
        prefix: the path so far (may be empty).
        name: the next field (may be empty).

    Returns:
        ``prefix.name``, or whichever of the two is non-empty.
    """
    if not name:
        return prefix
    return f"{prefix}.{name}" if prefix else name


def is_map_field(fd: FieldDescriptor) -> bool:
    """Whether a field is a protobuf map (``map<string, string> kafka_config``).

    Args:
        fd: the field.

    Returns:
        True for map fields.
    """
    return (fd.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE and fd.is_repeated
            and fd.message_type.GetOptions().map_entry)


def describe_value(value: Any) -> str:
    """A value as JSON for an error message, cut to 60 characters.

    Args:
        value: a decoded JSON value (or anything else, shown by ``repr``).

    Returns:
        The text.
    """
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
