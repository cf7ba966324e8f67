"""File and directory names of an export, shared by its writer and its readers.

``odl.export.exporter`` writes the layout (described in its module docstring);
``serving_plugin.export_reader`` reads it. The id-map file names (``DENSE_UPDATE_VARIABLES``,
``embed_name_to_ids.txt``) belong to ``publisher.id_maps``, which writes and reads them.
"""

from __future__ import annotations

import re

# serving_model.json's "format".
EXPORT_FORMAT = "odl.export/1"

DENSE_MODEL_FILE = "dense_model.pt"
SERVING_MODEL_FILE = "serving_model.json"
KAFKA_FILE = "kafka.txt"
CONFIG_FILE = "pipeline.config"
# The export's file manifest; the embeddings directory has one of its own, same name.
MANIFEST_FILE = "MANIFEST.json"
DONE_FILE = "DONE"
EMBEDDINGS_DIR = "embeddings"
ASSETS_DIR = "assets"
# A table's shard ``index`` inside ``embeddings/<table>/``.
SHARD_FILE = "part-{index:05d}.npy"
# A dynamic table's raw ids, one per row of the part of the same index.
IDS_FILE = "ids-{index:05d}.npy"

# A committed export directory's name: its unix time in seconds.
EXPORT_NAME = re.compile(r"^\d+$")


def temporary_export_name(name: str, pid: int) -> str:
    """Where export ``name`` is built before it is renamed into place (readers skip it).

    Args:
        name: the export's final name (``<unix-seconds>``).
        pid: the exporting process id.

    Returns:
        ``.tmp-<name>-<pid>``.
    """
    return f".tmp-{name}-{pid}"
