"""Secrets in pipeline configs: which values are secret, masking them, writing configs.

A string field, or a value of a string map (``kafka_config``), is secret when its field name
or map key contains one of :data:`SECRET_FIELD_MARKERS` (case-insensitive): the Kafka client
settings' markers (``password``, ``secret``, ``token``, ...) plus DataHub's and OSS's key
names. Secret values never leave the process unmasked:

* :func:`config_to_text` and :func:`save_pipeline_config` write ``***`` in their place
  (:func:`redact_config`);
* config errors never echo a value that may be secret (:func:`may_hold_secret`,
  :func:`mask_echoed_values`, used by the loader and the editor).

File written by :func:`save_pipeline_config`: the config in protobuf text format (UTF-8),
secrets masked, written to a temporary file ``.pipeline.*.tmp`` in the same directory, fsynced
and renamed into place, so a reader sees the old file or the new one.
"""

from __future__ import annotations

import os
import re
import tempfile

from google.protobuf import text_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from odl.config.config_fields import is_map_field
from odl.kafka.client_settings import SECRET_SETTING_MARKERS

__all__ = [
    "REDACTED",
    "SECRET_FIELD_MARKERS",
    "config_to_text",
    "is_secret_name",
    "mask_echoed_values",
    "may_hold_secret",
    "redact_config",
    "save_pipeline_config",
]

# A string field, or a value in a string map (kafka_config), is masked when its field name or
# map key contains one of these markers (case-insensitive). New secret fields get a marker here
# (DataHub akSecret and OSS access key secrets are covered by "secret").
SECRET_FIELD_MARKERS: tuple[str, ...] = tuple(SECRET_SETTING_MARKERS) + (
    "aksecret", "access_key_secret", "accesskeysecret", "sasl_password",
    "jaas",  # Java clients' sasl.jaas.config embeds the password
)
REDACTED = "***"


def is_secret_name(name: str) -> bool:
    """Whether a field name or map key names a secret (contains a ``SECRET_FIELD_MARKERS`` entry).

    Args:
        name: a field name, map key or dotted path segment.

    Returns:
        True when values under this name are masked.
    """
    lowered = name.lower()
    return any(marker in lowered for marker in SECRET_FIELD_MARKERS)


def redact_config(config: Message) -> Message:
    """Return a copy of ``config`` with secret values replaced by ``***``.

    A string field whose name, or a string-map value whose key, contains one of
    ``SECRET_FIELD_MARKERS`` is masked (when non-empty), at any depth.

    Args:
        config: any config message.

    Returns:
        A redacted copy; ``config`` is not modified.

    """
    copy = type(config)()
    copy.CopyFrom(config)
    _redact_in_place(copy)
    return copy


def _redact_in_place(msg: Message) -> None:
    for fd, value in msg.ListFields():
        if is_map_field(fd):
            value_fd = fd.message_type.fields_by_name["value"]
            if value_fd.cpp_type == FieldDescriptor.CPPTYPE_STRING:
                for key in list(value):
                    if is_secret_name(str(key)) and value[key]:
                        value[key] = REDACTED
            elif value_fd.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
                for key in list(value):
                    _redact_in_place(value[key])
        elif fd.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
            for sub in (value if fd.is_repeated else [value]):
                _redact_in_place(sub)
        elif fd.cpp_type == FieldDescriptor.CPPTYPE_STRING and is_secret_name(fd.name):
            if fd.is_repeated:
                for i in range(len(value)):
                    value[i] = REDACTED
            elif value:
                setattr(msg, fd.name, REDACTED)


def config_to_text(config: Message, redact: bool = True) -> str:
    """Render a config as protobuf text format.

    Args:
        config: the config.
        redact: mask secret values (see :func:`redact_config`).

    Returns:
        The text.

    """
    msg = redact_config(config) if redact else config
    return text_format.MessageToString(msg, as_utf8=True)


def save_pipeline_config(config: Message, path: str, redact: bool = True) -> None:
    """Write a config atomically (temp file in the same directory, then ``os.replace``).

    Args:
        config: the config.
        path: destination file; its directory is created if missing.
        redact: mask secret values (keep True for anything written to model_dir).

    """
    text = config_to_text(config, redact=redact)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".pipeline.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def may_hold_secret(path: str, text: str) -> bool:
    """Whether an error about ``path`` (or config ``text``) could echo a secret value.

    Args:
        path: the dotted path of the field the error is about.
        text: the config text (a line, or a value) the error could quote.

    Returns:
        True when the error must not show the offending value.
    """
    return ("kafka_config" in path or is_secret_name(path.rsplit(".", 1)[-1])
            or "kafka_config" in text or is_secret_name(text))


def mask_echoed_values(detail: str) -> str:
    """Cuts a parser message at its first quote: what follows echoes the input.

    Args:
        detail: protobuf's parse error text.

    Returns:
        The text up to the first quote, then ``***``.
    """
    m = re.search(r"['\"]", detail)
    return detail if m is None else detail[:m.start()].rstrip() + " " + REDACTED

