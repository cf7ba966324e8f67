"""Finding and reading checkpoints: full ones and increments, as one process's state.

A full checkpoint is read as written (``odl.checkpoint.checkpoint_manager``'s layout); an
increment through its chain (``odl.checkpoint.checkpoint_chain``): the base's tables with
every increment's changed rows applied in order, and the newest link's other state,
positions and manifest. Which checkpoint counts: :func:`usable_reason` (committed, intact,
and for an increment every link of its chain too).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Optional

import torch

from odl.checkpoint import checkpoint_chain, table_parts
from odl.checkpoint.checkpoint_chain import TABLE_ROWS_KEY, ChainLink
from odl.checkpoint.checkpoint_layout import (
    MANIFEST_FILE,
    MODEL_FILE,
    POSITIONS_FILE,
    CheckpointError,
    checkpoint_step,
    list_checkpoints,
    local_checkpoint_copy,
    verify_checkpoint,
)
from odl.models.dynamic.state_changes import apply_changes, apply_part_changes, is_changes
from odl.storage import file_store
from odl.storage.storage_path import basename, join

logger = logging.getLogger(__name__)


@dataclass
class LoadedCheckpoint:
    """What a checkpoint holds.

    Attributes:
        path: the checkpoint directory.
        global_step: training step it was taken at.
        state: the TrainModule state (model, optimizer, step).
        positions: next offset per partition (empty for offline checkpoints).
        source: the positions' source description (topic etc.).
        manifest: the parsed manifest.
        link: the checkpoint as the parent of a next increment.
        chain: the checkpoints it was read from (its base first; itself alone when full).
    """

    path: str
    global_step: int
    state: dict
    positions: dict[int, int]
    source: dict
    manifest: dict
    link: Optional[ChainLink] = None
    chain: tuple[str, ...] = ()


def usable_reason(path: str, verified: Optional[dict[str, Optional[str]]] = None
                  ) -> Optional[str]:
    """Why checkpoint ``path`` cannot be restored, or None when it can.

    It must be committed and match its manifest; an increment's every link too
    (``checkpoint_chain.chain_of``).

    Args:
        path: the checkpoint directory.
        verified: path -> reason of checkpoints verified already (filled in), so a
            fall-back through one chain verifies each link once.
    """
    verified = {} if verified is None else verified

    def check(p: str) -> Optional[str]:
        if p not in verified:
            verified[p] = verify_checkpoint(p)
        return verified[p]

    reason = check(path)
    if reason:
        return reason
    try:
        chain = checkpoint_chain.chain_of(path, verify_links=False)
    except CheckpointError as exc:
        return str(exc)
    for link in chain[:-1]:
        reason = check(link)
        if reason:
            return f"its chain needs {link}, which is not usable: {reason}"
    return None


def newest_usable(model_dir: str) -> Optional[str]:
    """The newest checkpoint of ``model_dir`` that can be restored (None: none).

    Others are skipped with a warning.

    Raises:
        odl.storage.oss_store.StorageError: OSS could not be listed.
    """
    verified: dict[str, Optional[str]] = {}
    for candidate in reversed(list_checkpoints(model_dir)):
        reason = usable_reason(candidate, verified)
        if reason is None:
            return candidate
        logger.warning("skipping damaged checkpoint %s: %s", candidate, reason)
    return None


def resolve_checkpoint_path(path: str) -> str:
    """A checkpoint directory, or a model_dir whose newest usable checkpoint is returned.

    Args:
        path: ``model.ckpt-N`` directory or a model_dir.

    Returns:
        The checkpoint directory.

    Raises:
        CheckpointError: nothing usable is there (for a checkpoint directory: why).
    """
    if checkpoint_step(path) is not None or file_store.is_file(join(path, MANIFEST_FILE)):
        reason = usable_reason(path)
        if reason:
            raise CheckpointError(f"checkpoint {path} is not usable: {reason}")
        return path
    found = newest_usable(path)
    if found is None:
        raise CheckpointError(f"no complete checkpoint in {path}")
    return found


def read_checkpoint(path: str, map_location: str = "cpu",
                    whole_tables: bool = True) -> LoadedCheckpoint:
    """Loads a verified checkpoint directory, full or an increment (through its chain).

    Args:
        path: checkpoint directory (verified by the caller or via resolve_checkpoint_path).
        map_location: device for the tensors.
        whole_tables: put the table parts of a checkpoint of several ranks back together;
            False leaves them on disk and ``state["table_parts"]`` names their local paths
            (``TrainModule.load_checkpoint_state`` of several ranks reads only the blocks
            of its own rows; ``assemble_table_parts`` makes them whole later; an
            increment's rows are then named by ``state["table_rows"]``), and maps the state
            file of a checkpoint of one process instead of reading it (a rank copying its
            own rows out of the whole tables reads only those pages; writes stay in this
            process).

    Returns:
        The loaded checkpoint.

    Raises:
        CheckpointError: the table parts do not make whole tables, or a link of an
            increment's chain is missing or is not the one it names.
    """
    local = local_checkpoint_copy(path)
    with open(os.path.join(local, MANIFEST_FILE), "rb") as f:
        manifest_bytes = f.read()
    manifest = json.loads(manifest_bytes)
    chain = [path]
    if manifest.get("increment"):
        chain = checkpoint_chain.chain_of(path, verify_links=False)
        state = _chain_state(chain, local, map_location, whole_tables)
    else:
        state = _full_state(path, local, map_location, whole_tables, dynamic_parts=True)
    positions: dict[int, int] = {}
    source: dict = {}
    pos_path = os.path.join(local, POSITIONS_FILE)
    if os.path.exists(pos_path):
        with open(pos_path) as f:
            source = json.load(f)
        positions = {int(k): int(v) for k, v in source.get("positions", {}).items()}
    return LoadedCheckpoint(
        path=path,
        global_step=int(manifest["global_step"]),
        state=state,
        positions=positions,
        source=source,
        manifest=manifest,
        link=checkpoint_chain.link_from_manifest(basename(path), manifest_bytes),
        chain=tuple(chain),
    )


def _full_state(path: str, local: str, map_location: str, whole_tables: bool,
                dynamic_parts: bool) -> dict:
    """The state of a full checkpoint (its local copy ``local``)."""
    state = torch.load(os.path.join(local, MODEL_FILE), map_location=map_location,
                       weights_only=True, mmap=not whole_tables)
    if state.get("table_parts"):  # written by several ranks
        state["table_parts"] = [os.path.join(local, name) for name in state["table_parts"]]
        if dynamic_parts:
            try:  # dynamic tables split by id: each rank's partition is in its part (mapped)
                table_parts.merge_dynamic_parts(
                    state, (table_parts.read_part(p, map_location, mmap=True)
                            for p in state["table_parts"]))
            except (OSError, ValueError) as exc:
                raise CheckpointError(f"checkpoint {path}: its table parts do not hold "
                                      f"the dynamic tables' partitions: {exc}") from exc
        if whole_tables:
            assemble_table_parts(state, path, map_location)
    return state


def _chain_state(chain: list[str], local: str, map_location: str, whole_tables: bool
                 ) -> dict:
    """The state of an increment (local copy ``local``) read through its chain."""
    base = _full_state(chain[0], local_checkpoint_copy(chain[0]), map_location,
                       whole_tables=False, dynamic_parts=False)
    state = torch.load(os.path.join(local, MODEL_FILE), map_location=map_location,
                       weights_only=True)
    rows: list[str] = []
    link_rows: list[list[str]] = []
    for link in chain[1:]:
        link_local = local if link == chain[-1] else local_checkpoint_copy(link)
        with open(os.path.join(link_local, MANIFEST_FILE)) as f:
            names = sorted(n for n in json.load(f)["files"]
                           if n.startswith(checkpoint_chain.ROWS_PREFIX))
        link_rows.append([os.path.join(link_local, n) for n in names])
        rows.extend(link_rows[-1])
    if is_changes(state.get("dynamic_tables")):
        state["dynamic_tables"] = _dynamic_through_chain(base, state, chain, local,
                                                         map_location)
    dynamic = state.get("dynamic_tables")
    if isinstance(dynamic, dict) and int(dynamic.get("partitions", 1)) > 1 \
            and not dynamic.get("parts"):
        try:  # split by id over ranks: each rank's partitions travel in its row files
            held = _dynamic_parts_through_chain(chain[0], link_rows, map_location)
            table_parts.merge_dynamic_parts(state, [{"dynamic_parts": held}])
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(f"checkpoint {chain[-1]}: its row files do not hold the "
                                  f"dynamic tables' partitions: {exc}") from exc
    dense = state.pop("model")
    del state[TABLE_ROWS_KEY]
    if base.get("table_parts"):
        state["table_parts"] = base["table_parts"]
        state["model"] = dense
        state[TABLE_ROWS_KEY] = rows
        if whole_tables:
            assemble_table_parts(state, chain[-1], map_location)
        return state
    state["model"] = {k: v for k, v in base["model"].items() if k not in dense}
    if whole_tables:  # read, not mapped
        state["model"] = {k: v.clone() for k, v in state["model"].items()}
    state["model"].update(dense)
    state["sparse_optimizer"] = {
        p: {k: (v.clone() if whole_tables else v) for k, v in st.items()}
        for p, st in base.get("sparse_optimizer", {}).items()}
    _apply_row_files(state, rows, chain[-1], map_location)
    return state


def _dynamic_through_chain(base: dict, state: dict, chain: list[str], local: str,
                           map_location: str) -> dict:
    """The dynamic tables' full state at an increment whose state holds their changes.

    The base's full state, then every increment's changes (or full state) in chain order
    (``odl.models.dynamic.state_changes``).
    """
    dynamic = base.get("dynamic_tables")
    try:
        for link in chain[1:]:
            if link == chain[-1]:
                saved = state["dynamic_tables"]
            else:
                saved = torch.load(os.path.join(local_checkpoint_copy(link), MODEL_FILE),
                                   map_location=map_location, weights_only=True,
                                   mmap=True).get("dynamic_tables")
            if dynamic is None or saved is None:
                raise ValueError(f"{link} or its parent holds no dynamic tables")
            dynamic = apply_changes(dynamic, saved) if is_changes(saved) else saved
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"checkpoint {chain[-1]}: its dynamic tables' changes do not "
                              f"apply to its chain: {exc}") from exc
    return dynamic


def _dynamic_parts_through_chain(base_path: str, link_rows: list[list[str]],
                                 map_location: str) -> dict[int, dict]:
    """The partitions of dynamic tables split over ranks at a chain's newest increment.

    Each increment's row files carry their rank's partitions, whole or as changes since the
    parent (``odl.models.dynamic.state_changes``); the changes apply, in chain order, to the
    partition as the link before left it (the base's table parts for the first).
    """
    parts: dict[int, dict] = {}
    base_parts: dict[int, dict] | None = None
    for files in link_rows:
        for path in files:
            doc = checkpoint_chain.read_rows(path, map_location, mmap=True)  # (rows unread)
            for p, part in (doc.get("dynamic_parts") or {}).items():
                p = int(p)
                if not is_changes(part):
                    parts[p] = part
                    continue
                if p not in parts:
                    if base_parts is None:
                        base_parts = _base_dynamic_parts(base_path, map_location)
                    if p not in base_parts:
                        raise ValueError(f"the chain's base lacks partition {p}")
                    parts[p] = base_parts[p]
                parts[p] = apply_part_changes(parts[p], part)
    return parts


def _base_dynamic_parts(path: str, map_location: str) -> dict[int, dict]:
    """The dynamic tables' partitions a full checkpoint of several ranks holds in its parts."""
    state = _full_state(path, local_checkpoint_copy(path), map_location, whole_tables=False,
                        dynamic_parts=True)
    return {int(p): v for p, v in (state["dynamic_tables"].get("parts") or {}).items()}


def _apply_row_files(state: dict, rows: list[str], path: str, map_location: str) -> None:
    """Applies the increments' row files (oldest first) to a state's whole tables."""
    try:
        merged = checkpoint_chain.merged_rows(
            checkpoint_chain.read_rows(p, map_location) for p in rows)
        checkpoint_chain.apply_rows(state["model"], state["sparse_optimizer"], merged)
    except (OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"checkpoint {path}: its increments do not apply to its "
                              f"base: {exc}") from exc


def assemble_table_parts(state: dict, path: str = "", map_location: str = "cpu") -> None:
    """Puts the table parts a state names back together (and an increment's rows on them).

    The parts (``read_checkpoint(whole_tables=False)``) become the state's ``"model"`` tables
    and ``"sparse_optimizer"``; a state without parts is left as it is.

    Args:
        state: the checkpoint state; changed in place.
        path: the checkpoint, for the error message.
        map_location: device for the tensors.

    Raises:
        CheckpointError: a part is unreadable, or the parts do not make whole tables.
    """
    if not state.get("table_parts"):
        return
    try:
        tables, sparse = table_parts.assemble(
            table_parts.read_part(p, map_location) for p in state["table_parts"])
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path}: its table parts do not make whole "
                              f"tables: {exc}") from exc
    del state["table_parts"]
    state["model"].update(tables)
    state["sparse_optimizer"] = sparse
    rows = state.pop(TABLE_ROWS_KEY, None)
    if rows:
        _apply_row_files(state, rows, path, map_location)
