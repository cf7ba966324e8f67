"""Reading a delta topic in order: the one path from a message to a complete version.

Serving's replay (``serving_plugin.delta_replayer``) and the trainer's crash recovery
(``publisher.delta_recovery``) read the same stream the same way, through
:class:`DeltaStreamReader`:

1. **decode** (``decode_chunk``): an empty, corrupt or oversized message is rejected with
   its reason (``DeltaFormatError.reason``, e.g. ``crc_mismatch``);
2. **model** (``publisher.model_identity``): when the read's owner generation names a model,
   chunks of another model's generations (a trainer of another model_dir that took the topic
   over) are rejected as ``other_model`` and never reach the fence;
3. **generation fence** (``publisher.generation_fence``): chunks of a generation superseded
   by a newer one (a zombie trainer) are rejected as ``fenced_generation``;
4. **assembly** (``VersionAssembler``): chunks become a version only when all of them
   arrived; a version cut short never completes;
5. **full-republish rule** (``publisher.full_republish``): a complete version that names a
   full republish the reader skipped (the topic lost versions and was refilled past the
   read position) is not handed on; ``rewind_to`` says where the read must start over,
   with the assembly restarted (:meth:`DeltaStreamReader.restart_assembly`).

What the caller does with a version (apply it to a served model, merge it into a recovered
state) and how it counts rejects is its own.
"""

from __future__ import annotations

import logging
from typing import Optional

from publisher.delta_decoder import decode_chunk
from publisher.delta_format import DeltaFormatError, DeltaVersion
from publisher.full_republish import FullRepublishes
from publisher.generation_fence import FENCED_REASON, GenerationFence
from publisher.model_identity import model_of_generation
from publisher.version_assembler import VersionAssembler

logger = logging.getLogger(__name__)

__all__ = ["OTHER_MODEL_REASON", "DeltaStreamReader"]

# The reject reason of a chunk of another model's generation.
OTHER_MODEL_REASON = "other_model"


class DeltaStreamReader:
    """Messages of one delta topic, in topic order, to complete versions (module docstring).

    Args:
        owner: the generation that owns the topic where the read starts (None: unknown).
        republishes: the full republishes the read holds; None: the rule is not checked.
        max_message_bytes: largest message accepted by the decoder.
        max_pending_versions: versions assembled at once (older incomplete ones are dropped).
        max_pending_bytes: bytes of chunks held for incomplete versions.
        what: who reads, for the log lines (``"delta replay"``, ``"delta recovery"``).

    Attributes:
        fence: the generation fence (its ``owner`` and ``superseded`` generations).
        model: the model id of ``owner`` (``""``: none, every model's chunks are read).
        assembler: the version assembler (``pending_versions``, ``dropped_versions``).
        rewind_to: the offset the read must start over from, or None.
        rewinds: how many times the read was asked to start over.
    """

    def __init__(self, owner: Optional[str], republishes: Optional[FullRepublishes],
                 max_message_bytes: int, max_pending_versions: Optional[int] = None,
                 max_pending_bytes: Optional[int] = None, what: str = "delta read") -> None:
        self.fence = GenerationFence(owner)
        self.model = model_of_generation(owner or "")
        self._republishes = republishes
        self._max_bytes = max_message_bytes
        self._limits = {k: v for k, v in (("max_pending_versions", max_pending_versions),
                                          ("max_pending_bytes", max_pending_bytes))
                        if v is not None}
        self.assembler = VersionAssembler(**self._limits)
        self._what = what
        self.rewind_to: Optional[int] = None
        self.rewinds = 0

    def read(self, data: bytes, offset: Optional[int]) -> Optional[DeltaVersion]:
        """The version ``data`` completes, or None (incomplete, or a rewind is due).

        Args:
            data: the message value.
            offset: its topic offset (for the log lines and the rewind).

        Returns:
            The complete version to apply or merge, else None.

        Raises:
            DeltaFormatError: the message is rejected; ``reason`` says why (a decoding
                reason, ``other_model`` or ``fenced_generation``).
        """
        if not data:  # parses as an all-default chunk; never a real version
            raise DeltaFormatError("empty", "empty message")
        chunk = decode_chunk(data, max_bytes=self._max_bytes)
        other = model_of_generation(chunk.header.generation)
        if self.model and other and other != self.model:
            raise DeltaFormatError(
                OTHER_MODEL_REASON, f"generation {chunk.header.generation} is model {other}'s, "
                                    f"not this read's model {self.model} (another model_dir "
                                    "publishes to the topic)")
        if not self.fence.admit(chunk.header.generation):
            raise DeltaFormatError(
                FENCED_REASON, f"generation {chunk.header.generation} was superseded by "
                               f"{self.fence.owner} (another trainer publishes to the topic)")
        version = self.assembler.add(chunk)
        if version is None:
            return None
        h = version.header
        target = self._republishes.skipped(h) if self._republishes is not None else None
        if target is None:
            return version
        self.rewinds += 1
        self.rewind_to = target
        logger.error("%s: version %d (generation %s) at offset %s names the full republish %d "
                     "at offset %d, which this read skipped (the delta topic lost versions and "
                     "was refilled past the read position); reading again from offset %d",
                     self._what, h.version, h.generation, offset, h.last_full_version, target,
                     target)
        return None

    def restart_assembly(self) -> None:
        """Forgets chunks of incomplete versions (they come again, or never complete)."""
        self.assembler = VersionAssembler(**self._limits)
