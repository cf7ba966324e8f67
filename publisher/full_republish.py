"""Which full republishes a replay of the delta topic holds, and which one it read past.

After the delta topic lost acknowledged versions the publisher sends a *full* version
(every row its generation ever published, every dense variable), and every later version of
the generation names it (``VersionHeader.last_full_version`` / ``last_full_offset``, a
``RepublishMark`` on the wire; ``publisher.delta_sender``). A replay that meets a version
naming a full version it does not hold read past it (its position was beyond the shortened
log's end when the log grew back) and must go back to the full version's first chunk and
replay on from there in topic order. Serving (``serving_plugin.delta_replayer``) and crash
recovery (``publisher.delta_recovery``) apply the same rule through ``FullRepublishes``.

A replay holds a full version when:

* its starting state does: the base's generation, at or before the base's version (an
  export's, a checkpoint's);
* it applied it (``applied``);
* it read from an offset at or before the full version's (``read_from``): the version was
  in what it read, whatever became of it;
* it went back to it once already: each full version is sought once, so a full version lost
  in turn cannot make a replay loop.
"""

from __future__ import annotations

from typing import Optional

from publisher.delta_format import VersionHeader


class FullRepublishes:
    """The full republishes a replay holds (see the module docstring).

    Args:
        base_generation: the generation of the state the replay starts from (None: none).
        base_version: that state's version (step); full versions of the base's generation
            at or before it are in the state.
        read_from: the replay read every message from this offset on (None: it may have
            jumped, so only what it applied counts).
    """

    def __init__(self, base_generation: Optional[str], base_version: Optional[int],
                 read_from: Optional[int] = None) -> None:
        self.base = (base_generation, base_version)
        self.read_from = read_from
        self._held: set[tuple[str, int]] = set()

    def applied(self, header: VersionHeader) -> None:
        """Notes a version the replay applied (a full one is held from now on)."""
        if header.full_republish:
            self._held.add((header.generation, int(header.version)))

    def skipped(self, header: VersionHeader) -> Optional[int]:
        """The offset to go back to when ``header`` names a full version not held, else None.

        The full version counts as held afterwards (it is sought once).
        """
        key = (header.generation, int(header.last_full_version))
        offset = int(header.last_full_offset)
        generation, version = self.base
        if (not key[1] or offset < 0 or key in self._held
                or (self.read_from is not None and offset >= self.read_from)
                or (key[0] == generation and version is not None and key[1] <= version)):
            return None
        self._held.add(key)
        return offset
