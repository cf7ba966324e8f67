"""Which model a delta version belongs to: the model id in every generation.

A trainer start's generation is ``<model id>.<start id>``: the model id is the first 16 hex
digits of the SHA-256 of the trainer's ``model_dir`` (the same for every start of the same
model), the start id is random per start. Every chunk of the delta topic carries its
generation, so a reader can tell one model's versions from another's
(``publisher.delta_topic_owner``, ``publisher.delta_stream``). A generation without a model id
(16 hex digits alone) names no model.
"""

from __future__ import annotations

import hashlib
import os
import uuid

_MODEL_ID_HEX = 16


def model_id(model_dir: str) -> str:
    """The model id of a ``model_dir``: 16 hex digits of the SHA-256 of its normalized path.

    A local path is made absolute and normalized; a URL (``oss://...``) is taken as written,
    less a trailing ``/``.
    """
    path = model_dir.rstrip("/") if "://" in model_dir else os.path.abspath(model_dir)
    return hashlib.sha256(path.encode()).hexdigest()[:_MODEL_ID_HEX]


def new_generation(model_dir: str) -> str:
    """A trainer start's generation: ``<model id>.<16 random hex digits>``."""
    return f"{model_id(model_dir)}.{uuid.uuid4().hex[:16]}"


def model_of_generation(generation: str) -> str:
    """The model id a generation names (``""`` for a generation without one)."""
    head, dot, _ = generation.partition(".")
    return head if dot and len(head) == _MODEL_ID_HEX else ""
