r"""EasyRec's feature settings: vocabularies, raw value normalization, expanded names.

* ``vocab_list`` / ``vocab_file`` (IdFeature, TagFeature): EasyRec's
  ``categorical_column_with_vocabulary_list`` / ``_file`` with ``default_value=0``: a value's
  row is its index in the vocabulary (the line number in the file, from 0), a value not in it
  gets row 0 (the first entry's row; EasyRec has no out-of-vocabulary bucket), and the table
  has one row per entry. Values are compared as text. A vocabulary is one of the table
  kinds: give exactly one of ``hash_bucket_size``, ``num_buckets``, ``vocab_list``,
  ``vocab_file``. A dynamic table (``ev_params``, also model-wide, ``zch``,
  ``ctr_accessor_param``) is keyed by the vocabulary index as its raw id. Entries must be
  unique and not empty (TensorFlow's lookup table refuses duplicates). ``vocab_file`` is
  read through the storage layer (local or ``oss://``), UTF-8, one entry per line (``\n``
  or ``\r\n``); a relative path is relative to the config file's directory
  (:func:`resolve_vocab_files`, called by the loader; a config parsed from text resolves it
  against the working directory); an export writes its entries as ``vocab_list``
  (:func:`with_vocab_files_inlined`), so that it is self-contained.
* ``min_val`` / ``max_val`` (RawFeature): with ``max_val > min_val`` the value becomes
  ``(x - min_val) / (max_val - min_val)`` (EasyRec's input preprocessing; not clipped, so
  values outside the range fall outside ``[0, 1]``); ``boundaries`` then apply to the
  normalized value. Setting them with ``max_val <= min_val`` (which EasyRec silently
  ignores) is refused.
* ``normalizer`` (RawFeature; TorchEasyRec's ``raw_feature.normalizer``): the generator's
  transform of the value before ``boundaries`` or use as a number
  (:mod:`odl.config.raw_normalizer`); not together with ``min_val`` / ``max_val``.
* ``num_buckets`` on a RawFeature (or a SequenceFeature of numbers) with ``max_val >
  min_val`` and no ``boundaries``: EasyRec's equal-width bucketization of the normalized
  value, the boundaries ``[0, 1/n, ..., (n-1)/n]`` (``n + 1`` rows);
  :func:`raw_num_buckets_to_boundaries` rewrites it so.
* ``hash_bucket_size`` on a RawFeature: EasyRec never reads it (a RawFeature is dense, or
  bucketized by ``boundaries``, or projected by ``embedding_dim``); odl refuses it rather
  than ignoring it.
* ``data_config.auto_expand_input_fields`` and feature group names: EasyRec's
  ``auto_expand_names``: a name that starts with ``<letters and _>[<first>-<last>]``
  stands for ``<prefix><first>`` ... ``<prefix><last>`` (what follows ``]`` is dropped, as
  EasyRec's ``re.match`` does). Input fields are expanded only with the flag; feature group
  names always (EasyRec's ``FeatureGroup``).
"""

from __future__ import annotations

import os
import re

from odl.config.config_error import ConfigError
from odl.config.feature_configs import feature_configs, feature_list_path
from odl.config.raw_normalizer import parse_normalizer
from odl.protos import pipeline_pb2

__all__ = [
    "expand_config_names",
    "expand_names",
    "has_vocabulary",
    "normalizes",
    "raw_num_buckets_to_boundaries",
    "read_vocabulary",
    "resolve_vocab_files",
    "validate_feature_settings",
    "vocabulary_size",
    "with_vocab_files_inlined",
    "with_vocabularies_as_buckets",
]

_FT = pipeline_pb2.FeatureConfig.FeatureType
_EXPAND = re.compile(r"([a-zA-Z_]+)\[([0-9]+)-([0-9]+)\]")
# Names one expansion may produce (a typo such as c[1-100000000] must not hang the loader).
MAX_EXPANDED_NAMES = 100_000


def expand_names(name: str, where: str = "") -> list[str]:
    """EasyRec's ``auto_expand_names``: ``"c[1-3]"`` is ``["c1", "c2", "c3"]``.

    Args:
        name: an input field or feature name.
        where: the field path, for errors.

    Returns:
        The expanded names, or ``[name]`` when it has no ``[first-last]`` range.

    Raises:
        ConfigError: the range is empty (last < first) or longer than MAX_EXPANDED_NAMES.
    """
    m = _EXPAND.match(name)
    if m is None:
        return [name]
    prefix, first, last = m.group(1), int(m.group(2)), int(m.group(3))
    if last < first or last - first + 1 > MAX_EXPANDED_NAMES:
        raise ConfigError(where or name, f"{name!r}: the range [{first}-{last}] must hold 1 to "
                                         f"{MAX_EXPANDED_NAMES:,} names")
    return [f"{prefix}{i}" for i in range(first, last + 1)]


def expand_config_names(config: pipeline_pb2.EasyRecConfig) -> None:
    """Expands ``[first-last]`` names in place (module docstring); idempotent.

    Args:
        config: a parsed config.

    Raises:
        ConfigError: an empty or too long range.
    """
    dc = config.data_config
    if dc.auto_expand_input_fields and any(_EXPAND.match(f.input_name) for f in dc.input_fields):
        fields = list(dc.input_fields)
        expanded = []
        for i, f in enumerate(fields):
            for name in expand_names(f.input_name, f"data_config.input_fields[{i}].input_name"):
                one = pipeline_pb2.DatasetConfig.Field()
                one.CopyFrom(f)
                one.input_name = name
                expanded.append(one)
        del dc.input_fields[:]
        dc.input_fields.extend(expanded)
    for i, g in enumerate(config.model_config.feature_groups):
        if not any(_EXPAND.match(n) for n in g.feature_names):
            continue
        names = [x for j, n in enumerate(g.feature_names) for x in expand_names(
            n, f"model_config.feature_groups[{i}].feature_names[{j}]")]
        del g.feature_names[:]
        g.feature_names.extend(names)


def expand_shared_names(config: pipeline_pb2.EasyRecConfig) -> None:
    """EasyRec's ``shared_names``: one more feature per shared column, in place; idempotent.

    Each name (a ``[first-last]`` range expanded with ``auto_expand_input_fields``, as
    EasyRec does) gets a copy of the feature's settings reading that column and named after
    it; the copies follow the features of their list (EasyRec's order). A shared table comes
    from ``embedding_name``, as for any feature.

    Args:
        config: a parsed config.

    Raises:
        ConfigError: an empty or too long range.
    """
    auto = config.data_config.auto_expand_input_fields
    for prefix, container in (("feature_configs", config.feature_configs),
                              ("feature_config.features", config.feature_config.features)):
        extra = []
        for i, fc in enumerate(container):
            if not fc.shared_names:
                continue
            names = [x for n in fc.shared_names
                     for x in (expand_names(n, f"{prefix}[{i}].shared_names")
                               if auto else [n])]
            fc.ClearField("shared_names")
            for name in names:
                one = pipeline_pb2.FeatureConfig()
                one.CopyFrom(fc)
                one.ClearField("input_names")
                one.ClearField("feature_name")
                one.input_names.append(name)
                extra.append(one)
        container.extend(extra)


def raw_num_buckets_to_boundaries(fc: pipeline_pb2.FeatureConfig) -> None:
    """EasyRec's ``num_buckets`` on a normalized RawFeature as the boundaries it means.

    A RawFeature with ``num_buckets > 1``, ``max_val > min_val`` and no ``boundaries`` gets
    ``boundaries = [k / num_buckets for k in range(num_buckets)]`` and no ``num_buckets``; a
    SequenceFeature of numbers so set gets the same buckets over its raw values,
    ``boundaries = [min_val + (max_val - min_val) * k / num_buckets ...]``, and neither
    ``num_buckets`` nor ``min_val`` / ``max_val``; anything else is left as it is (and
    validated as written). Idempotent.

    Args:
        fc: a feature config, changed in place.
    """
    if (fc.feature_type == _FT.RawFeature and fc.num_buckets > 1 and fc.max_val > fc.min_val
            and not fc.boundaries):
        n = int(fc.num_buckets)
        fc.boundaries.extend(k / float(n) for k in range(n))
        fc.ClearField("num_buckets")
    elif (fc.feature_type == _FT.SequenceFeature and fc.sub_feature_type == _FT.RawFeature
            and fc.num_buckets > 1 and fc.max_val > fc.min_val and not fc.boundaries):
        # a sequence's numbers are not normalized otherwise (EasyRec normalizes them only
        # here), so the same buckets are written over the values as they are
        n = int(fc.num_buckets)
        lo, span = float(fc.min_val), float(fc.max_val) - float(fc.min_val)
        fc.boundaries.extend(lo + span * k / n for k in range(n))
        for field in ("num_buckets", "min_val", "max_val"):
            fc.ClearField(field)


def normalizes(fc: pipeline_pb2.FeatureConfig) -> bool:
    """Whether a RawFeature's value is normalized by ``min_val`` / ``max_val``."""
    return fc.feature_type == _FT.RawFeature and fc.max_val > fc.min_val


def has_vocabulary(fc: pipeline_pb2.FeatureConfig) -> bool:
    """Whether a feature's ids come from ``vocab_list`` or ``vocab_file``."""
    return bool(fc.vocab_list) or bool(fc.vocab_file)


def resolve_vocab_files(config: pipeline_pb2.EasyRecConfig, config_path: str) -> None:
    """Makes every relative ``vocab_file`` relative to the config file's directory, in place.

    Args:
        config: the config loaded from ``config_path``.
        config_path: the config file (local or ``oss://bucket/key``).
    """
    if not config_path:
        return
    remote = "://" in config_path
    base = config_path.rsplit("/", 1)[0] if remote else os.path.dirname(
        os.path.abspath(config_path))
    for fc in list(config.feature_configs) + list(config.feature_config.features):
        path = fc.vocab_file
        if not path or "://" in path or os.path.isabs(path):
            continue
        fc.vocab_file = f"{base}/{path}" if remote else os.path.join(base, path)


def read_vocabulary(fc: pipeline_pb2.FeatureConfig, where: str) -> list[str]:
    """The vocabulary of a feature: ``vocab_list``, or the lines of ``vocab_file``.

    Args:
        fc: a feature with a vocabulary.
        where: the feature's path, for errors.

    Returns:
        The entries in row order.

    Raises:
        ConfigError: both given, the file missing or unreadable, an entry empty or repeated,
            or no entry.
    """
    from odl.storage import file_store  # the storage layer (oss2) only where a file is read

    if fc.vocab_list and fc.vocab_file:
        raise ConfigError(f"{where}.vocab_file", "give one of vocab_list and vocab_file")
    if fc.vocab_list:
        entries, field = list(fc.vocab_list), f"{where}.vocab_list"
    else:
        field = f"{where}.vocab_file"
        try:
            text = file_store.read_text(fc.vocab_file)
        except FileNotFoundError:
            raise ConfigError(field, f"file not found: {fc.vocab_file}") from None
        except (OSError, UnicodeDecodeError, ValueError, RuntimeError) as e:
            raise ConfigError(field, f"cannot read {fc.vocab_file}: {e}") from None
        entries = [line[:-1] if line.endswith("\r") else line for line in text.split("\n")]
        if entries and entries[-1] == "":  # the newline ending the last line
            entries.pop()
    if not entries:
        raise ConfigError(field, "the vocabulary is empty")
    seen: dict[str, int] = {}
    for i, entry in enumerate(entries):
        if not entry:
            raise ConfigError(field, f"entry {i} is empty (an empty value never has an id)")
        if entry in seen:
            raise ConfigError(field, f"{entry!r} repeats (entries {seen[entry]} and {i})")
        seen[entry] = i
    return entries


def vocabulary_size(fc: pipeline_pb2.FeatureConfig, where: str = "feature") -> int:
    """Rows of a vocabulary feature's table (entries of ``vocab_list`` / ``vocab_file``)."""
    return len(fc.vocab_list) if fc.vocab_list else len(read_vocabulary(fc, where))


def validate_feature_settings(config: pipeline_pb2.EasyRecConfig) -> None:
    """Checks vocabularies, ``min_val`` / ``max_val`` and a RawFeature's ``hash_bucket_size``.

    The rules are the module docstring's; the rest of each feature is
    :func:`odl.config.model_validation.validate_features`'s.

    Args:
        config: a normalized config.

    Raises:
        ConfigError: naming the first offending field.
    """
    prefix = feature_list_path(config)
    for i, fc in enumerate(feature_configs(config)):
        where = f"{prefix}[{i}]"
        kind = _FT.Name(fc.feature_type)
        if fc.normalizer:
            if fc.feature_type != _FT.RawFeature:
                raise ConfigError(f"{where}.normalizer", f"normalizes a RawFeature, not a {kind}")
            if normalizes(fc):
                raise ConfigError(f"{where}.normalizer", "give normalizer or min_val / max_val, "
                                                         "not both")
            parse_normalizer(fc.normalizer, f"{where}.normalizer")
        if fc.HasField("min_val") or fc.HasField("max_val"):
            if fc.feature_type != _FT.RawFeature:
                raise ConfigError(f"{where}.min_val",
                                  f"min_val / max_val normalize a RawFeature, not a {kind}")
            if not fc.max_val > fc.min_val:
                raise ConfigError(f"{where}.max_val",
                                  f"max_val ({fc.max_val:g}) must be above min_val "
                                  f"({fc.min_val:g}); EasyRec ignores the pair otherwise")
        if not has_vocabulary(fc):
            continue
        if fc.feature_type != _FT.IdFeature:
            raise ConfigError(f"{where}.vocab_list" if fc.vocab_list else f"{where}.vocab_file",
                              f"a vocabulary maps the ids of an IdFeature or TagFeature, not of "
                              f"a {kind}")
        for other in ("hash_bucket_size", "num_buckets"):
            if getattr(fc, other):
                raise ConfigError(f"{where}.{other}",
                                  "give one of hash_bucket_size, vocab_list, vocab_file and "
                                  "num_buckets (EasyRec silently uses the first one set, in "
                                  "that order)")
        read_vocabulary(fc, where)


def with_vocab_files_inlined(config: pipeline_pb2.EasyRecConfig) -> pipeline_pb2.EasyRecConfig:
    """The config with each ``vocab_file`` replaced by its entries as ``vocab_list``.

    An export writes this form, so that it is self-contained (serving never needs the file).

    Args:
        config: a validated config.

    Returns:
        ``config`` itself when no feature has a ``vocab_file``, else a changed copy.

    Raises:
        ConfigError: a vocabulary file cannot be read.
    """
    entries = list(config.feature_configs) or list(config.feature_config.features)
    if not any(fc.vocab_file for fc in entries):
        return config
    copy = pipeline_pb2.EasyRecConfig()
    copy.CopyFrom(config)
    prefix = feature_list_path(copy)
    for i, fc in enumerate(copy.feature_configs or copy.feature_config.features):
        if fc.vocab_file:
            vocab = read_vocabulary(fc, f"{prefix}[{i}]")
            fc.ClearField("vocab_file")
            fc.vocab_list.extend(vocab)
    return copy


def with_vocabularies_as_buckets(config: pipeline_pb2.EasyRecConfig,
                                 ) -> pipeline_pb2.EasyRecConfig:
    """The config with each vocabulary feature as the ``num_buckets`` feature of its size.

    For the checks that know only hash_bucket_size and num_buckets (table size limits,
    sharing): a vocabulary feature's table has one row per entry.

    Args:
        config: a config whose features passed :func:`validate_feature_settings`.

    Returns:
        ``config`` itself when no feature has a vocabulary, else a changed copy.
    """
    if not any(has_vocabulary(fc) for fc in feature_configs(config)):
        return config
    copy = pipeline_pb2.EasyRecConfig()
    copy.CopyFrom(config)
    prefix = feature_list_path(copy)
    entries = copy.feature_configs or copy.feature_config.features
    for i, fc in enumerate(entries):
        if has_vocabulary(fc):
            fc.num_buckets = vocabulary_size(fc, f"{prefix}[{i}]")
            fc.ClearField("vocab_list")
            fc.ClearField("vocab_file")
    return copy
