"""Dynamic embedding tables as configured: one spec behind three config forms.

The forms are EasyRec's, TorchEasyRec's and PaddleRec's. A feature's table is *dynamic*
when the feature (an ``IdFeature`` or ``ComboFeature``) sets
one of these, or when ``model_config.ev_params`` is set and the feature sets none:

* ``ev_params { filter_freq steps_to_live max_capacity }`` (EasyRec / DeepRec
  EmbeddingVariable): admission after ``filter_freq`` sightings (and, odl's extension, with
  ``admit_probability`` at each step), eviction of rows unseen for
  ``steps_to_live`` steps, least recently used rows make room when the table is full;
  ``max_capacity`` rows (``hash_bucket_size`` when ``max_capacity`` is not written and the
  feature has one). With neither written the table *grows*, as EasyRec's EmbeddingVariable
  does: it starts at ``init_capacity`` rows when written, else ``GROWING_START_ROWS``, and
  doubles as ids are admitted up to ``EV_DEFAULT_MAX_CAPACITY`` (``grows_to``);
* ``zch { zch_size eviction_interval lfu{} | lru{} | distance_lfu{} }`` (TorchEasyRec
  zero-collision hash): ``zch_size`` rows, the policy decides which rows make room;
* ``ctr_accessor_param { ... }`` (PaddleRec ``CtrCommonAccessor``): rows scored by decayed
  show / click counts; admission at ``embedx_threshold``, eviction below
  ``delete_threshold`` or after ``delete_after_unseen_days``, publishing above
  ``delta_threshold``, export above ``base_threshold``.

:func:`dynamic_table_spec` turns a feature's config into a :class:`DynamicTableSpec` (or
``None`` for a fixed, hashed table) and raises ``ConfigError`` naming the field for anything
odl cannot honour. The engine that applies a spec is ``odl.models.dynamic``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from odl.config.config_error import ConfigError
from odl.protos import pipeline_pb2

__all__ = ["DynamicTableSpec", "dynamic_table_spec", "EV_DEFAULT_MAX_CAPACITY",
           "EV_MAINTENANCE_INTERVAL", "GROWING_START_ROWS"]

_FT = pipeline_pb2.FeatureConfig.FeatureType
# Steps between two maintenance passes (expiry by steps_to_live) of an ev_params table, at
# most: a quarter of steps_to_live when that is shorter, so a row outlives it by 25 % at most.
EV_MAINTENANCE_INTERVAL = 100
# Largest table odl builds (rows); beyond it the memory estimate is meaningless anyway.
MAX_DYNAMIC_CAPACITY = 1 << 34
# EasyRec's default max_capacity: the rows a growing table (ev_params with neither
# max_capacity nor hash_bucket_size) may reach.
EV_DEFAULT_MAX_CAPACITY = 16_777_216
# Rows a growing table starts with unless ev_params.init_capacity is written.
GROWING_START_ROWS = 1 << 20
# the most ids a table with a disk tier may hold (a raw-id index's bound)
MOST_IDS = (1 << 31) - 1


@dataclass(frozen=True)
class DynamicTableSpec:
    """How one dynamic table admits, evicts, publishes and exports rows.

    Attributes:
        form: the config form it came from: ``"ev_params"``, ``"zch"`` or
            ``"ctr_accessor_param"``.
        capacity: rows of the table (live ids at most); a growing table's rows now.
        grows_to: the rows a growing table may reach, doubling as ids are admitted
            (``odl.train.table_growth``); 0: the table keeps ``capacity`` rows.
        admit_freq: sightings an id needs before it gets a row (<= 1: at once).
        admit_score: score (show / click, counted before admission) an id needs (0: none).
        admit_probability: chance that a candidate passing the thresholds gets a row at a
            step it appears in (1: always).
        policy: which rows make room when the table is full: ``"lru"``, ``"lfu"``,
            ``"distance_lfu"`` or ``"score"``.
        decay_exponent: ``distance_lfu``'s age exponent.
        maintenance_interval: steps between maintenance passes (expiry, decay, deletes).
        steps_to_live: evict rows unseen for this many steps (0: never by steps).
        click_coeff: weight of a click in the score.
        nonclk_coeff: weight of a shown, unclicked sample in the score.
        decay_rate_per_day: show / click multiplier per day of stream time (1: no decay).
        delete_threshold: evict rows whose score is below this (None: never by score).
        delete_after_unseen_days: evict rows unseen for this many days (None: never by time).
        delta_threshold: publish only rows whose score is at least this (None: every row).
        delta_keep_days: publish only rows seen within this many days (None: every row).
        base_threshold: export only rows whose score is at least this (None: every row).
        show_field: input field counting a sample's shows ("": 1 per sample).
        click_field: input field counting a sample's clicks ("": the label, positive = 1).
        disk_rows: with the disk tier (``train_config.disk_tier``), the most rows on disk
            (-1: bounded by the disk only); 0: no disk tier.
        disk_after_unseen_days: with the disk tier, rows unseen this many days move to disk
            at the maintenance pass (None: only to make room).
    """

    form: str
    capacity: int
    grows_to: int = 0
    admit_freq: int = 0
    admit_score: float = 0.0
    admit_probability: float = 1.0
    policy: str = "lru"
    decay_exponent: float = 1.0
    maintenance_interval: int = EV_MAINTENANCE_INTERVAL
    steps_to_live: int = 0
    click_coeff: float = 1.0
    nonclk_coeff: float = 0.1
    decay_rate_per_day: float = 1.0
    delete_threshold: Optional[float] = None
    delete_after_unseen_days: Optional[float] = None
    delta_threshold: Optional[float] = None
    delta_keep_days: Optional[float] = None
    base_threshold: Optional[float] = None
    show_field: str = ""
    click_field: str = ""
    disk_rows: int = 0
    disk_after_unseen_days: Optional[float] = None

    @property
    def grows(self) -> bool:
        """Whether the table grows from ``capacity`` towards ``grows_to`` rows."""
        return self.grows_to > self.capacity

    @property
    def max_rows(self) -> int:
        """The most rows the table can have: ``grows_to`` for a growing table, else ``capacity``."""
        return max(self.capacity, self.grows_to)

    @property
    def most_ids(self) -> int:
        """The most ids the table holds: ``max_rows`` plus its disk tier's rows.

        The id maps' and serving's bound; with a tier bounded by the disk only, ``MOST_IDS``.
        """
        if not self.disk_rows:
            return self.max_rows
        return MOST_IDS if self.disk_rows < 0 else min(self.max_rows + self.disk_rows, MOST_IDS)

    @property
    def counts_candidates(self) -> bool:
        """Whether ids are counted before admission (a frequency or score threshold)."""
        return self.admit_freq > 1 or self.admit_score > 0

    @property
    def keeps_scores(self) -> bool:
        """Whether rows carry show / click counts (the score policy or a score threshold)."""
        return (self.policy == "score" or self.delete_threshold is not None
                or self.delta_threshold is not None or self.base_threshold is not None)


def _capacity(value: int, path: str) -> int:
    if value < 1:
        raise ConfigError(path, "a dynamic table needs at least 1 row")
    if value > MAX_DYNAMIC_CAPACITY:
        raise ConfigError(path, f"{value} rows is more than odl builds ({MAX_DYNAMIC_CAPACITY})")
    return int(value)


def _probability(value: float, path: str) -> float:
    if not 0.0 < value <= 1.0:
        raise ConfigError(path, f"must be in (0, 1], got {value}")
    return float(value)


def _from_ev(ev: pipeline_pb2.EVParams, fc: pipeline_pb2.FeatureConfig, path: str,
             feature_path: str) -> DynamicTableSpec:
    grows_to = 0
    if ev.HasField("max_capacity"):
        capacity = _capacity(int(ev.max_capacity), f"{path}.max_capacity")
    elif fc.hash_bucket_size:
        capacity = _capacity(int(fc.hash_bucket_size), f"{feature_path}.hash_bucket_size")
    else:  # no written capacity: the table grows, as EasyRec's EmbeddingVariable does
        grows_to = EV_DEFAULT_MAX_CAPACITY
        start = (int(ev.init_capacity) if ev.HasField("init_capacity")
                 else GROWING_START_ROWS)
        capacity = min(_capacity(start, f"{path}.init_capacity"), grows_to)
        if capacity == grows_to:
            grows_to = 0
    ttl = int(ev.steps_to_live)
    interval = min(EV_MAINTENANCE_INTERVAL, max(1, ttl // 4)) if ttl else EV_MAINTENANCE_INTERVAL
    return DynamicTableSpec(
        form="ev_params", capacity=capacity, grows_to=grows_to,
        admit_freq=int(ev.filter_freq),
        admit_probability=_probability(ev.admit_probability, f"{path}.admit_probability"),
        policy="lru",
        maintenance_interval=interval, steps_to_live=ttl)


def _from_zch(z: pipeline_pb2.ZeroCollisionHash, path: str) -> DynamicTableSpec:
    if not z.zch_size:
        raise ConfigError(f"{path}.zch_size", "required: the rows of the table")
    if z.threshold_filtering_func:
        raise ConfigError(f"{path}.threshold_filtering_func",
                          "a TorchEasyRec field odl does not implement (it would run Python "
                          "from the config); use zch.filter_freq for admission by count")
    which = z.WhichOneof("eviction_policy") or "lru"
    decay = 1.0
    if which == "distance_lfu":
        decay = float(z.distance_lfu.decay_exponent)
        if not decay > 0:
            raise ConfigError(f"{path}.distance_lfu.decay_exponent", "must be > 0")
    if z.eviction_interval < 1:
        raise ConfigError(f"{path}.eviction_interval", "must be >= 1")
    return DynamicTableSpec(
        form="zch", capacity=_capacity(int(z.zch_size), f"{path}.zch_size"),
        admit_freq=int(z.filter_freq), policy=which, decay_exponent=decay,
        admit_probability=_probability(z.admit_probability, f"{path}.admit_probability"),
        maintenance_interval=int(z.eviction_interval))


def _from_accessor(a: pipeline_pb2.CtrAccessorParameter, fc: pipeline_pb2.FeatureConfig,
                   path: str) -> DynamicTableSpec:
    rows = int(a.capacity or fc.hash_bucket_size)
    if not rows:
        raise ConfigError(f"{path}.capacity",
                          "required when the feature has no hash_bucket_size: the rows of "
                          "the table")
    if not 0 < a.show_click_decay_rate <= 1:
        raise ConfigError(f"{path}.show_click_decay_rate", "must be in (0, 1]")
    if a.shrink_interval_steps < 1:
        raise ConfigError(f"{path}.shrink_interval_steps", "must be >= 1")
    for name in ("nonclk_coeff", "click_coeff", "delete_after_unseen_days", "delta_keep_days"):
        if getattr(a, name) < 0:
            raise ConfigError(f"{path}.{name}", "must be >= 0")
    return DynamicTableSpec(
        form="ctr_accessor_param",
        capacity=_capacity(rows, f"{path}.capacity"),
        admit_score=max(0.0, float(a.embedx_threshold)),
        policy="score",
        maintenance_interval=int(a.shrink_interval_steps),
        click_coeff=float(a.click_coeff),
        nonclk_coeff=float(a.nonclk_coeff),
        decay_rate_per_day=float(a.show_click_decay_rate),
        delete_threshold=float(a.delete_threshold),
        delete_after_unseen_days=float(a.delete_after_unseen_days),
        delta_threshold=float(a.delta_threshold),
        delta_keep_days=float(a.delta_keep_days),
        base_threshold=float(a.base_threshold),
        show_field=a.show_field,
        click_field=a.click_field,
    )


def dynamic_table_spec(
    fc: pipeline_pb2.FeatureConfig,
    model_ev: Optional[pipeline_pb2.EVParams],
    path: str,
    disk_tier: Optional[pipeline_pb2.DiskTier] = None,
) -> Optional[DynamicTableSpec]:
    """The dynamic-table spec of a feature, or None when its table is a fixed hashed one.

    Args:
        fc: the feature's config.
        model_ev: ``model_config.ev_params`` when the config sets it, else None.
        path: the feature's config path (``feature_configs[3]`` or
            ``feature_config.features[3]``, as ``feature_list_path`` gives it), for errors.
        disk_tier: ``train_config.disk_tier`` (:func:`with_disk_tier`); None: none.

    Returns:
        The spec, or None.

    Raises:
        ConfigError: several forms on one feature, a form on a feature type that has no id
            table, or a bad value (the message names the field).
    """
    forms = [f for f in ("ev_params", "zch", "ctr_accessor_param") if fc.HasField(f)]
    if len(forms) > 1:
        raise ConfigError(f"{path}.{forms[1]}",
                          f"a feature sets at most one of ev_params, zch and "
                          f"ctr_accessor_param (it sets {' and '.join(forms)})")
    if not forms and model_ev is None:
        return None
    if fc.feature_type not in (_FT.IdFeature, _FT.ComboFeature):
        if forms:
            raise ConfigError(f"{path}.{forms[0]}",
                              "only IdFeature and ComboFeature tables can be dynamic")
        return None
    if not forms:
        spec = _from_ev(model_ev, fc, "model_config.ev_params", path)
    elif forms[0] == "ev_params":
        spec = _from_ev(fc.ev_params, fc, f"{path}.ev_params", path)
    elif forms[0] == "zch":
        spec = _from_zch(fc.zch, f"{path}.zch")
    else:
        spec = _from_accessor(fc.ctr_accessor_param, fc, f"{path}.ctr_accessor_param")
    if disk_tier is not None and disk_tier.dir:
        accessor = fc.ctr_accessor_param if forms == ["ctr_accessor_param"] else None
        spec = with_disk_tier(spec, disk_tier, accessor)
    return spec


def with_disk_tier(spec: DynamicTableSpec, tier: pipeline_pb2.DiskTier,
                   accessor: Optional[pipeline_pb2.CtrAccessorParameter] = None
                   ) -> DynamicTableSpec:
    """``spec`` with the disk tier: ``ram_rows`` rows in RAM, the rest on disk.

    The RAM rows are ``tier.ram_rows`` (0: the table's capacity; a growing table's start
    rows: it does not grow). PaddleRec's ``ssd_unseenday_threshold`` (> 0) moves rows unseen
    that many days to disk at the maintenance pass.
    """
    ram = int(tier.ram_rows) or spec.capacity
    unseen = (float(accessor.ssd_unseenday_threshold)
              if accessor is not None and accessor.ssd_unseenday_threshold > 0 else None)
    return replace(spec, capacity=_capacity(ram, "train_config.disk_tier.ram_rows"),
                   grows_to=0, disk_rows=int(tier.max_disk_rows) or -1,
                   disk_after_unseen_days=unseen)
