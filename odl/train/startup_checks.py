"""What ``odl-train`` checks before it builds anything: the config against this machine.

:func:`~odl.models.model_registry.check_pipeline_config` checks a config on its own;
:func:`check_start` checks what a start will need from the machine, so that a config that
passes ``odl-train --validate_only`` also starts, and a start that cannot work exits with
code 2 and one line naming the field before a table is allocated. Both ``--validate_only``
and a normal start run it. In order:

1. Device: ``--device cuda`` needs a CUDA device; ``auto`` resolves to CUDA when one is
   available, else CPU. The table optimizer must run on that device, fused or row-sparse
   (see :mod:`odl.config.optimizer_support`); where the tables run
   differently from what the config names (EasyRec's ``adam_optimizer`` as lazy Adam) the
   check returns a note saying so, which ``--validate_only`` prints and a start logs as a
   warning.
2. Kafka client settings: the consumer of ``kafka_train_input``, the dead-letter producer
   and the delta producer (and its recovery consumer) of ``incr_save_config.kafka`` are
   constructed with the settings the trainer will use and closed at once, without a broker
   (``bootstrap.servers`` left out), so librdkafka refuses bad settings now (an unknown
   property such as Java's ``sasl.jaas.config``, a missing ``ssl.key.location`` file, an
   unsupported ``sasl.mechanism``). Its message is passed on with every secret value masked.
3. Memory: :func:`odl.train.memory_estimate.check_memory` (the model as built, on the
   ``meta`` device); then ``train_config.freeze_gradient``'s patterns against that model's
   names (:func:`odl.train.frozen_parameters.check_freeze_gradient`).
4. Paths: when ``model_dir`` holds no checkpoint, ``fine_tune_checkpoint`` must resolve to
   a complete checkpoint (a ``model.ckpt-N`` directory, or a directory whose newest intact
   checkpoint is used). The directory of ``--sample_ledger``,
   ``incr_save_config.fs.incr_save_dir`` and ``model_dir`` must be directories or creatable,
   and a probe file must be creatable and removable in them (``/proc/self``, read-only
   mounts and files are refused). Directories created for a probe are removed again, except
   ``model_dir`` on a start that passes every check (``create_dirs``). For ``oss://``
   paths the OSS credentials and endpoint must be configured and the local mirror of
   ``model_dir`` must be writable; OSS itself is not contacted except to look for
   checkpoints (an OSS outage is not a config error: it fails the start with exit 1).
"""

from __future__ import annotations

import functools
import logging
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from odl.config.config_error import ConfigError
from odl.config.config_redaction import REDACTED, SECRET_FIELD_MARKERS
from odl.config.optimizer_support import optimizer_choices, table_optimizer_plan
from odl.inputs.kafka_source import UNPACED_QUEUE_BACKOFF_MS
from odl.kafka.client_settings import consumer_config, delta_consumer_config, producer_config
from odl.protos import pipeline_pb2
from odl.storage import file_store
from odl.storage.oss_credentials import OssCredentialsError, oss_credentials
from odl.storage.storage_path import is_remote, join
from odl.train.frozen_parameters import check_freeze_gradient
from odl.train.memory_estimate import (
    MemoryEstimate,
    check_memory,
    growth_notes,
    resolve_max_memory_fraction,
)

logger = logging.getLogger(__name__)

__all__ = [
    "StartCheck",
    "check_device_support",
    "check_fine_tune_checkpoint",
    "check_kafka_settings",
    "check_start",
    "check_writable_dir",
    "resolve_device_type",
]

_PROBE_PREFIX = ".odl-write-probe-"

# Settings KafkaSource adds to the consumer (odl.inputs.kafka_source), so that librdkafka
# checks the same combination the trainer will create.
_KAFKA_SOURCE_SETTINGS = {"queued.max.messages.kbytes": 16384, "auto.offset.reset": "error"}

_JAVA_ONLY_HINT = ("sasl.jaas.config is a Java client setting; librdkafka takes "
                   "sasl.mechanism, sasl.username and sasl.password instead")


@dataclass(frozen=True)
class StartCheck:
    """What :func:`check_start` found.

    Attributes:
        device_type: the resolved device, ``"cpu"`` or ``"cuda"``.
        memory: the memory estimate.
        notes: what the start will do differently from the config (e.g. Adam tables run
            lazily), one sentence each.
    """

    device_type: str
    memory: MemoryEstimate
    notes: tuple[str, ...] = ()


# --------------------------------------------------------------------------- device


def resolve_device_type(device: str) -> str:
    """Resolves ``--device`` as the trainer will.

    Args:
        device: ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.

    Returns:
        ``"cpu"`` or ``"cuda"``.

    Raises:
        ConfigError: CUDA is requested but not available, or the value is unknown.
    """
    if device == "cpu":
        return "cpu"
    if device != "auto" and device != "cuda" and not re.fullmatch(r"cuda:\d+", device):
        raise ConfigError("--device", f"expected auto, cpu or cuda, got {device!r}")
    import torch

    available = torch.cuda.is_available()
    if device == "auto":
        return "cuda" if available else "cpu"
    if not available:
        raise ConfigError("--device", f"{device} requested but no CUDA device is available "
                                      "(use --device cpu or auto)")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise ConfigError("--device", f"{device} requested but there are only "
                                      f"{torch.cuda.device_count()} CUDA devices")
    return "cuda"


def check_device_support(
    config: pipeline_pb2.EasyRecConfig, device_type: str
) -> tuple[str, ...]:
    """Refuses a table optimizer that cannot run on ``device_type`` (fused or row-sparse).

    Args:
        config: the config.
        device_type: ``"cpu"`` or ``"cuda"``.

    Returns:
        Notes on how the tables' update differs from the configured one (empty: none).

    Raises:
        ConfigError: naming the optimizer field, e.g. LAMB tables on CPU.
    """
    sparse, _dense = optimizer_choices(config.train_config)
    if not sparse.kind:
        return ()
    plan = table_optimizer_plan(sparse, device_type)
    return (plan.note,) if plan.note else ()


def _cuda_free_bytes() -> int | None:
    try:
        import torch

        free, _total = torch.cuda.mem_get_info()
        return int(free)
    except (RuntimeError, AssertionError) as exc:  # no driver context: skip the device side
        logger.warning("cannot read free CUDA memory (%s); skipping the device memory check",
                       exc)
        return None


# --------------------------------------------------------------------------- paths


def check_writable_dir(path: str, field: str, keep_created: bool = False) -> None:
    """Refuses a directory that cannot be created or written.

    Missing directories are created for the probe and, unless ``keep_created``, removed
    again afterwards (only the ones this call created). They are always removed when the
    check fails.

    Args:
        path: the directory.
        field: config field (or option) named in the error.
        keep_created: leave the directories created for the probe (a start that goes on to
            use them).

    Raises:
        ConfigError: the path is a file, cannot be created, or a probe file cannot be
            created and removed in it.
    """
    path = os.path.abspath(path)
    created: list[str] = []
    ok = False
    try:
        if os.path.lexists(path) and not os.path.isdir(path):
            raise ConfigError(field, f"{path} exists and is not a directory")
        for attempt in range(3):
            _create_missing(path, field, created)
            try:
                fd, probe = tempfile.mkstemp(prefix=_PROBE_PREFIX, dir=path)
                try:
                    os.write(fd, b"odl")
                finally:
                    os.close(fd)
                    os.unlink(probe)
                break
            except FileNotFoundError as exc:
                if attempt < 2:  # removed meanwhile (another process's probe): again
                    continue
                raise ConfigError(field, f"{path} is not a writable directory: "
                                         f"{exc.strerror or exc}") from None
            except OSError as exc:
                raise ConfigError(field, f"{path} is not a writable directory: "
                                         f"{exc.strerror or exc}") from None
        ok = True
    finally:
        for directory in reversed(created if not (ok and keep_created) else []):
            try:
                os.rmdir(directory)
            except OSError:
                pass


def _create_missing(path: str, field: str, created: list[str]) -> None:
    """Creates the missing directories of ``path``, appending each one made to ``created``."""
    missing = []
    head = path
    while not os.path.isdir(head):
        if os.path.lexists(head):
            raise ConfigError(field, f"cannot create {path}: {head} is not a directory")
        missing.append(head)
        parent = os.path.dirname(head)
        if parent == head:
            break
        head = parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory)
        except FileExistsError:
            continue
        except OSError as exc:
            raise ConfigError(field, f"cannot create {path}: {exc.strerror or exc}") from None
        created.append(directory)


def _has_checkpoint(model_dir: str) -> bool:
    from odl.checkpoint.checkpoint_manager import list_checkpoints

    try:
        return bool(list_checkpoints(model_dir))
    except OSError:
        return False
    except OssCredentialsError as exc:
        raise ConfigError("model_dir", str(exc)) from None


def check_fine_tune_checkpoint(config: pipeline_pb2.EasyRecConfig) -> str | None:
    """Resolves ``train_config.fine_tune_checkpoint`` when a start would use it.

    The trainer warm-starts from it only when ``model_dir`` holds no checkpoint (otherwise it
    resumes its own); then it must be a complete checkpoint, or a directory holding one.

    Args:
        config: the config.

    Returns:
        The checkpoint directory a start would load, or None when none would be loaded.

    Raises:
        ConfigError: naming ``train_config.fine_tune_checkpoint``.
    """
    path = config.train_config.fine_tune_checkpoint
    if not path or _has_checkpoint(config.model_dir):
        return None
    from odl.checkpoint.checkpoint_manager import CheckpointError, resolve_checkpoint_path

    _check_oss_credentials("train_config.fine_tune_checkpoint", path)
    if not file_store.exists(path):
        raise ConfigError("train_config.fine_tune_checkpoint", f"{path} does not exist")
    try:
        return resolve_checkpoint_path(path)
    except (CheckpointError, OSError, ValueError, KeyError) as exc:
        raise ConfigError("train_config.fine_tune_checkpoint",
                          f"no usable checkpoint: {exc}") from None


def _check_oss_credentials(field: str, path: str) -> None:
    """For an ``oss://`` path: the credentials and endpoint must be configured."""
    if not is_remote(path):
        return
    try:
        oss_credentials()
    except OssCredentialsError as exc:
        raise ConfigError(field, str(exc)) from None


def _check_paths(config: pipeline_pb2.EasyRecConfig, sample_ledger: str | None,
                 create_dirs: bool) -> None:
    # OSS reachability is not checked here: an outage is not a config error (restore fails
    # with exit 1 and systemd retries), but missing credentials are
    _check_oss_credentials("model_dir", config.model_dir)
    check_fine_tune_checkpoint(config)
    if sample_ledger:
        if os.path.isdir(sample_ledger):
            raise ConfigError("--sample_ledger", f"{sample_ledger} is a directory")
        check_writable_dir(os.path.dirname(os.path.abspath(sample_ledger)), "--sample_ledger")
    isc = config.train_config.incr_save_config
    if config.train_config.HasField("incr_save_config") and \
            isc.WhichOneof("incr_update") == "fs":
        directory = isc.fs.incr_save_dir
        if not is_remote(directory) and not os.path.isabs(directory):
            directory = join(config.model_dir, directory)
        if is_remote(directory):
            _check_oss_credentials("train_config.incr_save_config.fs.incr_save_dir", directory)
        else:
            check_writable_dir(directory, "train_config.incr_save_config.fs.incr_save_dir")
    if is_remote(config.model_dir):
        # checkpoints are staged in the local mirror
        check_writable_dir(file_store.cache_dir_for(config.model_dir), "model_dir (local "
                           "mirror, $ODL_CACHE_DIR)", keep_created=create_dirs)
    else:
        check_writable_dir(config.model_dir, "model_dir", keep_created=create_dirs)


# --------------------------------------------------------------------------- kafka


def _is_secret_key(key: str) -> bool:
    lowered = key.lower()
    return any(marker in lowered for marker in SECRET_FIELD_MARKERS)


def _mask_secrets(message: str, settings: Mapping[str, Any]) -> str:
    """``message`` with every secret value of ``settings`` masked.

    Values of secret settings are replaced wherever they occur; when the message names a
    secret setting, every quoted value in it is masked as well. A short secret (under 4
    characters) that occurs in the message withholds the whole message.
    """
    for key, value in settings.items():
        if not _is_secret_key(str(key)) or not isinstance(value, str) or not value:
            continue
        if value in message:
            if len(value) < 4:
                return "(details withheld: they could reveal a secret setting)"
            message = message.replace(value, REDACTED)
    named = [k for k in settings if _is_secret_key(str(k)) and f'"{k}"' in message]
    if named:
        message = re.sub(r'"([^"]*)"',
                         lambda m: m.group(0) if m.group(1) in named else f'"{REDACTED}"',
                         message)
    return message


@functools.lru_cache(maxsize=64)
def _client_refusal(kind: str, items: tuple[tuple[str, Any], ...]) -> str | None:
    """The refusal librdkafka gives a client's settings (unmasked), None if it accepts them.

    Cached: the same settings give the same answer, and a process validating many configs
    (tests, tools) creates each client once.
    """
    from confluent_kafka import Consumer, KafkaException, Producer

    conf: dict[str, Any] = {k: v for k, v in items if k != "bootstrap.servers"}
    quiet = logging.getLogger("odl.config.kafka_settings_check")
    quiet.propagate = False
    if not quiet.handlers:
        quiet.addHandler(logging.NullHandler())
    conf["logger"] = quiet  # librdkafka's own log lines would go to stderr
    try:
        client = Consumer(conf) if kind == "consumer" else Producer(conf)
    except (KafkaException, ValueError, TypeError) as exc:
        err = exc.args[0] if exc.args else exc
        text = err.str() if hasattr(err, "str") else str(err)
        return " ".join(str(text).split())
    try:
        if hasattr(client, "close"):
            client.close()
        else:  # older confluent-kafka producers have no close()
            client.flush(0)
    except Exception as exc:  # noqa: BLE001 - closing a client that never connected
        logger.debug("closing the %s created for the settings check: %s", kind, exc)
    return None


def _try_client(kind: str, settings: dict[str, Any], field: str,
                extra: Mapping[str, str]) -> None:
    """Constructs and closes a librdkafka client; a refusal becomes a ConfigError."""
    try:
        items = tuple(sorted((str(k), v) for k, v in settings.items()))
        refusal = _client_refusal(kind, items)
    except TypeError:  # an unhashable value: check without the cache
        refusal = _client_refusal.__wrapped__(kind, tuple(settings.items()))
    if refusal is None:
        return
    hint = ""
    if any(k.lower() == "sasl.jaas.config" for k in extra):
        hint = f" ({_JAVA_ONLY_HINT})"
    raise ConfigError(field, f"librdkafka refuses the {kind} settings: "
                             f"{_mask_secrets(refusal, settings)}{hint}")


def check_kafka_settings(config: pipeline_pb2.EasyRecConfig, online: bool) -> None:
    """Lets librdkafka check the settings of every Kafka client a start will create.

    No broker is contacted: each client is created without ``bootstrap.servers`` and closed.

    Args:
        config: the config.
        online: the training mode (the input consumer and dead-letter producer are online
            only).

    Raises:
        ConfigError: naming the ``kafka_config`` field, with librdkafka's message (secret
            values masked).
    """
    if online and config.HasField("datahub_train_input"):
        d = config.datahub_train_input
        for value, env, name in ((d.akId, "DATAHUB_ACCESS_KEY_ID", "akId"),
                                 (d.akSecret, "DATAHUB_ACCESS_KEY_SECRET", "akSecret")):
            if not value and not os.environ.get(env):
                raise ConfigError(f"datahub_train_input.{name}",
                                  f"required (or the {env} environment variable)")
    if online and config.HasField("kafka_train_input"):
        ki = config.kafka_train_input
        extra = dict(ki.kafka_config)
        field = "kafka_train_input.kafka_config"
        conf = consumer_config(ki.server, ki.group or "odl", extra)
        dc = config.data_config
        source = dict(_KAFKA_SOURCE_SETTINGS)
        if dc.fetch_interval_ms:
            source.update({"queued.min.messages": 1,
                           "fetch.queue.backoff.ms": int(dc.fetch_interval_ms)})
        else:
            source.update({"queued.min.messages": max(4 * int(dc.batch_size), 1000),
                           "fetch.queue.backoff.ms": UNPACED_QUEUE_BACKOFF_MS})
        for key, value in source.items():
            if key not in extra:
                conf[key] = value
        _try_client("consumer", conf, field, extra)
        if config.data_config.dead_letter_topic:
            _try_client("producer", producer_config(ki.server, extra, idempotent=False), field,
                        extra)
    tc = config.train_config
    if tc.HasField("incr_save_config") and tc.incr_save_config.WhichOneof("incr_update") \
            == "kafka":
        k = tc.incr_save_config.kafka
        extra = dict(k.kafka_config)
        field = "train_config.incr_save_config.kafka.kafka_config"
        delta: dict[str, Any] = {"message.max.bytes": str(
            max(1_000_000, int(tc.incr_save_config.max_chunk_bytes) + (64 << 10)))}
        if k.fence_producers:
            delta["transactional.id"] = f"odl-delta.{k.topic}"
        delta.update(extra)
        _try_client("producer", producer_config(k.server, delta, idempotent=True), field, extra)
        if online:
            _try_client("consumer", delta_consumer_config(k.server, "odl-recovery", extra), field,
                        extra)


# --------------------------------------------------------------------------- all


def check_start(
    config: pipeline_pb2.EasyRecConfig,
    *,
    online: bool,
    device: str = "auto",
    max_memory_fraction: float | None = None,
    sample_ledger: str | None = None,
    create_dirs: bool = False,
    ranks: int | None = None,
) -> StartCheck:
    """Every start-up check, in order (see the module docstring); allocates nothing.

    Call it on a config that passed ``check_pipeline_config``.

    Args:
        config: the config.
        online: ``--online``.
        device: ``--device``.
        max_memory_fraction: ``--max_memory_fraction`` (None: the environment variable
            ``ODL_MAX_MEMORY_FRACTION``, else 0.8).
        sample_ledger: ``--sample_ledger``, when given.
        create_dirs: leave ``model_dir`` created when the checks pass (a start creates it
            anyway); False removes whatever the checks created.
        ranks: ranks on this host about to be started (``odl-train --nproc``); None: this
            process's, from ``torchrun``'s ``WORLD_SIZE`` / ``LOCAL_WORLD_SIZE``.

    Returns:
        The resolved device and the memory estimate.

    Raises:
        ConfigError: the first problem, naming the field (or the option).
    """
    fraction = resolve_max_memory_fraction(max_memory_fraction)
    device_type = resolve_device_type(device)
    notes = check_device_support(config, device_type)
    check_kafka_settings(config, online)
    device_free = _cuda_free_bytes() if device_type == "cuda" and fraction > 0 else None
    if ranks is None:  # torchrun's, before the group is joined
        ranks = int(os.environ.get("WORLD_SIZE", "1"))
        on_host = int(os.environ.get("LOCAL_WORLD_SIZE", ranks))
    else:
        on_host = ranks
    estimate = check_memory(config, device_type, fraction, device_available=device_free,
                            ranks=ranks, ranks_on_host=on_host)
    check_freeze_gradient(config)
    _check_paths(config, sample_ledger, create_dirs)  # last: may leave model_dir created
    return StartCheck(device_type, estimate, (*notes, *growth_notes(estimate)))
