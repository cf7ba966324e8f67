"""DataHub input: the real ``pydatahub`` SDK against the loopback double.

What a user relies on: records come in shard order with positions a checkpoint can resume
from exactly (nothing twice, nothing lost), EasyRec's start forms work, split and merged
shards are read parent first, outages and throttling lose nothing and show in
``broker_error``, expired positions are reported, secrets never show.
"""

from __future__ import annotations

import json
import logging
import threading

import pytest

from odl.config.config_error import ConfigError
from odl.config.pipeline_config import parse_pipeline_config_text
from odl.datagen.datagen_config import deepfm_config_text
from odl.harness.datahub_double import DatahubDouble
from odl.inputs.datahub_source import DatahubSource, parse_datahub_start
from odl.inputs.source_factory import online_source_args
from odl.models.model_registry import check_pipeline_config

P, T = "proj", "topic"


@pytest.fixture
def dh():
    with DatahubDouble() as double:
        yield double


def _source(dh, start=None, batch=50, **kw) -> DatahubSource:
    return DatahubSource(dh.endpoint, "id", "dh-secret-value", P, T,
                         start or parse_datahub_start("", "", None), batch,
                         batch_timeout_ms=50, **kw)


def _drain(src: DatahubSource, want: int, stop=None) -> list[tuple[int, int, bytes]]:
    out: list[tuple[int, int, bytes]] = []
    for _ in range(500):
        if len(out) >= want:
            break
        b = src.read_batch(stop)
        if b is not None:
            out += list(zip(b.partitions.tolist(), b.offsets.tolist(), b.values, strict=True))
    return out


def _load(dh, shards: int, n: int) -> dict[int, list[bytes]]:
    dh.create_topic(P, T, shards=shards)
    data = {s: [f"s{s}-r{i},1".encode() for i in range(n)] for s in range(shards)}
    for s, vals in data.items():
        dh.append(P, T, str(s), vals)
    return data


@pytest.mark.parametrize("protocol", ["pb", "json"])
def test_reads_every_record_once_in_shard_order_and_resumes_exactly(dh, protocol) -> None:
    data = _load(dh, 3, 120)
    src = _source(dh, protocol=protocol)
    assert src.open() == {0: 0, 1: 0, 2: 0}
    first = _drain(src, 150)
    b = src.read_batch()
    first += list(zip(b.partitions.tolist(), b.offsets.tolist(), b.values, strict=True))
    resume = b.positions
    # a restart from the positions of the last batch reads the rest, nothing twice
    src2 = _source(dh, parse_datahub_start("", "", resume), protocol=protocol)
    assert src2.open() == resume
    rest = _drain(src2, 360 - len(first))
    got = first + rest
    assert len(got) == 360 and len({(p, o) for p, o, _ in got}) == 360
    for s in range(3):
        mine = [(o, v) for p, o, v in got if p == s]
        assert [o for o, _ in mine] == list(range(120))
        assert [v for _, v in mine] == data[s]


def test_easyrec_start_forms(dh) -> None:
    _load(dh, 2, 10)
    seq = _source(dh, parse_datahub_start('{"0": 7, "1": 3}', "", None))
    assert seq.open() == {0: 7, 1: 3}
    cursor = dh_cursor(dh, "1", 5)
    cur = _source(dh, parse_datahub_start(json.dumps({"1": {"cursor": cursor}}), "", None))
    cur.open()
    got = _drain(cur, 15)
    assert sorted(o for p, o, _ in got if p == 1) == list(range(5, 10))
    late = _source(dh, parse_datahub_start('{"timestamp": 4102444800}', "", None))
    assert late.open() == {0: 10, 1: 10}  # nothing at or after 2100-01-01 yet
    assert parse_datahub_start("", "20220508 12:00:00", None).timestamp_s == 1652011200.0


def dh_cursor(dh, shard: str, seq: int) -> str:
    from datahub import DataHub
    from datahub.models import CursorType

    client = DataHub("id", "k", dh.endpoint, enable_pb=False, user_agent="test")
    return client.get_cursor(P, T, shard, CursorType.SEQUENCE, seq).cursor


@pytest.mark.parametrize("protocol", ["pb", "json"])
def test_tuple_topics_map_fields_by_name(dh, protocol) -> None:
    dh.create_topic(P, T, shards=1, fields=[("label", "bigint"), ("C1", "string"),
                                            ("extra", "string")])
    dh.append(P, T, "0", [[1, "a", "x"], [0, None, "y"]])
    src = _source(dh, protocol=protocol)
    src.open()
    got = [json.loads(v) for _, _, v in _drain(src, 2)]
    # a null field: None in JSON; the protobuf SDK reads it as "" (both are "empty" to the
    # record parser, which then takes the field's default_val)
    null = None if protocol == "json" else ""
    assert got == [{"label": 1, "C1": "a", "extra": "x"}, {"label": 0, "C1": null,
                                                          "extra": "y"}]


def test_split_and_merge_read_parents_to_their_end_first(dh) -> None:
    _load(dh, 2, 5)
    a, b = dh.split_shard(P, T, "0")
    dh.append(P, T, a, [b"child-a"])
    dh.append(P, T, b, [b"child-b"])
    merged = dh.merge_shards(P, T, a, b)
    dh.append(P, T, merged, [b"merged"])
    src = _source(dh, batch=3)
    src.open()
    got = _drain(src, 13)
    order = [v for _, _, v in got]
    assert len(got) == 13
    assert order.index(b"s0-r4,1") < order.index(b"child-a") < order.index(b"merged")
    assert order.index(b"child-b") < order.index(b"merged")
    dh.append(P, T, merged, [b"last"])
    last = src.read_batch()
    assert last.values == [b"last"]
    assert set(last.positions) == {0, 1, int(a), int(b), int(merged)}


def test_outages_and_throttling_lose_nothing_and_show(dh, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    _load(dh, 2, 200)
    src = _source(dh)
    src.open()
    got = _drain(src, 100)
    dh.set_down(True)
    errors: list = []
    stop = threading.Event()

    def read() -> None:
        got.extend(_drain(src, 400 - len(got), stop))

    t = threading.Thread(target=read)
    t.start()
    for _ in range(200):
        if src.broker_error:
            break
        stop.wait(0.02)
    errors.append(src.broker_error)
    dh.set_down(False)
    dh.throttle_next(3)
    t.join(30)
    assert errors[0] and "ServiceUnavailable" in errors[0]
    assert src.broker_error is None
    assert sorted((p, o) for p, o, _ in got) == [(s, i) for s in range(2) for i in range(200)]
    assert "dh-secret-value" not in caplog.text and "dh-secret-value" not in repr(src)


def test_an_expired_position_continues_at_the_oldest_with_a_warning(dh, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="odl.inputs.datahub_source")
    _load(dh, 1, 50)
    dh.expire(P, T, "0", 20)
    src = _source(dh, parse_datahub_start("", "", {0: 5}))
    assert src.open() == {0: 20}
    assert "15 records lost to retention" in caplog.text
    assert [o for _, o, _ in _drain(src, 30)] == list(range(20, 50))


def _config(extra: str) -> str:
    text = deepfm_config_text("/tmp/m", topic=T)
    return text.replace('kafka_train_input {', extra + '\nkafka_train_input {', 1)


@pytest.mark.parametrize("section, field", [
    ('datahub_train_input { endpoint: "http://x" topic: "t" }', "datahub_train_input.project"),
    ('datahub_train_input { project: "p" topic: "t" }', "datahub_train_input.endpoint"),
    ('datahub_train_input { endpoint: "http://x" project: "p" topic: "t" '
     'offset_info: "{\\"0\\": {\\"cur\\": 1}}" }', "datahub_train_input.offset_info"),
    ('datahub_train_input { region: "cn-hangzhou" project: "p" topic: "t" '
     'offset_time: "yesterday" }', "datahub_train_input.offset_time"),
])
def test_config_errors_name_the_field(section: str, field: str) -> None:
    text = deepfm_config_text("/tmp/m", topic=T)
    start = text.index("kafka_train_input {")
    end = text.index("}", start) + 1
    config = parse_pipeline_config_text(text[:start] + section + text[end:])
    with pytest.raises(ConfigError) as err:
        check_pipeline_config(config, online=True)
    assert err.value.field == field


def test_both_inputs_are_refused_and_the_region_becomes_the_endpoint() -> None:
    config = parse_pipeline_config_text(_config(
        'datahub_train_input { region: "cn-hangzhou" project: "p" topic: "t" }'))
    with pytest.raises(ConfigError) as err:
        check_pipeline_config(config, online=True)
    assert "one online input" in str(err.value)
    config.ClearField("kafka_train_input")
    check_pipeline_config(config, online=True)
    _start, args = online_source_args(config, None)
    assert args["kind"] == "datahub" and args["endpoint"] == "https://dh-cn-hangzhou.aliyuncs.com"


def test_two_ranks_split_the_shards_and_follow_splits(dh) -> None:
    """Rank r of 2 reads the shards s with s % 2 == r, new ones from a split included;
    together they read every record once and each rank's positions name only its shards."""
    data = _load(dh, 3, 20)
    ranks = [_source(dh, batch=200, rank=r, world_size=2) for r in range(2)]
    assert ranks[0].open() == {0: 0, 2: 0} and ranks[1].open() == {1: 0}
    first = [_drain(src, want) for src, want in zip(ranks, (40, 20), strict=True)]
    a, b = dh.split_shard(P, T, "1")  # shard 1 (rank 1) closes; children 3 and 4
    dh.append(P, T, a, [b"child-a"])
    dh.append(P, T, b, [b"child-b"])
    for src in ranks:
        src._refresh_shards(None)
    then = [_drain(src, 1) for src in ranks]
    got = first[0] + first[1] + then[0] + then[1]
    assert len(got) == 62 and len({(p, o) for p, o, _ in got}) == 62
    assert {v for _, _, v in got} == {v for vals in data.values() for v in vals} | {
        b"child-a", b"child-b"}
    for r, src in enumerate(ranks):
        assert all(int(p) % 2 == r for p, _, _ in first[r] + then[r])
        assert set(src.partitions) == {s for s in (0, 1, 2, int(a), int(b)) if s % 2 == r}
    with pytest.raises(ValueError, match="owns none"):  # rank 5 of 6 over shards 0..4
        _source(dh, rank=5, world_size=6).open()
