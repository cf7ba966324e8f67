"""A backbone layer's settings, read as EasyRec's ``Parameter.get_or_default`` reads them.

A layer's settings are its ``KerasLayer`` params message (e.g. ``fm { }``) or
``st_params`` (a struct, :class:`~odl.models.backbone.block_registry.BlockArgs`'s
``st_params`` dict). EasyRec's reading, kept here: from a message, a string or repeated field
when non-empty, another field when set, else the layer's default; from ``st_params``, the key
when present, else the default. Each reader refuses a value of the wrong kind by field.
"""

import math
from typing import Any, Optional

from google.protobuf.message import Message

from odl.models.backbone.block_registry import BlockArgs


def params_message(args: BlockArgs, message_type: type, field: str,
                   required: bool = False) -> Optional[Message]:
    """The layer's params message of ``message_type``, or ``None`` for ``st_params``.

    Args:
        args: the builder's arguments.
        message_type: the message class the layer reads (e.g. ``pipeline_pb2.FM``).
        field: its ``KerasLayer`` field name, for errors.
        required: the layer reads only the message (EasyRec's ``get_pb_config``).

    Raises:
        ConfigError: another layer's message, or none where one is required.
    """
    if isinstance(args.params, message_type):
        return args.params
    if args.params is not None:
        raise args.refuse(f"takes {field} {{ }}" + ("" if required else " or st_params")
                          + f", not {type(args.params).__name__}")
    if required:
        raise args.refuse(f"needs its settings in {field} {{ }}")
    return None


def only_st_params(args: BlockArgs) -> None:
    """Refuses a params message for a layer configured by ``st_params`` alone."""
    if args.params is not None:
        raise args.refuse(f"takes st_params, not {type(args.params).__name__}")


def setting(args: BlockArgs, message: Optional[Message], key: str, default: Any) -> Any:
    """A setting as EasyRec's ``Parameter.get_or_default`` reads it.

    With a message: the field when set (a string or repeated field: when non-empty), else
    ``default``; with ``st_params``: ``st_params[key]``, else ``default``.
    """
    if message is not None:
        value = getattr(message, key)
        if isinstance(value, str):
            return value if value else default
        if hasattr(value, "__len__"):  # repeated
            return list(value) if len(value) else default
        return value if message.HasField(key) else default
    return args.st_params.get(key, default)


def bool_setting(args: BlockArgs, message: Optional[Message], key: str,
                 default: bool) -> bool:
    """A true/false setting; a number counts by its truth (EasyRec's ``bool(value)``).

    Raises:
        ConfigError: a string, list or struct.
    """
    value = setting(args, message, key, default)
    if not isinstance(value, (bool, int, float)):
        raise args.refuse(f"st_params.{key} must be true or false, got {value!r}")
    return bool(value)


def int_setting(args: BlockArgs, key: str, value: Any, minimum: int) -> int:
    """A whole number of at least ``minimum``.

    Raises:
        ConfigError: another value.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or value != int(value) or int(value) < minimum:
        raise args.refuse(f"{key} must be a whole number >= {minimum}, got {value!r}")
    return int(value)


def float_setting(args: BlockArgs, message: Optional[Message], key: str,
                  default: float) -> float:
    """A number setting (EasyRec's ``get_or_default``), finite.

    Raises:
        ConfigError: a value that is not a finite number.
    """
    value = setting(args, message, key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(float(value)):
        raise args.refuse(f"{key} must be a number, got {value!r}")
    return float(value)
