"""MovieLens 100k as a time-ordered stream (``odl-datagen --movielens DIR``).

The data itself may not be redistributed, so these tests write a few ratings in the
archive's own file formats (tab-separated ``u.data``, ``|``-separated ``u.user`` and
``u.item`` in latin-1; the later archives' ``ratings.csv`` and ``movies.csv``) and check
what a user relies on: ratings in time order, labels from the rating, the sample config
reading every record, every rating produced once.
"""

from __future__ import annotations

import glob
import json
import os
from datetime import datetime, timezone

import pytest

from odl.datagen.movielens_stream import MOVIELENS_COLUMNS, START_TIME, MovieLensStream
from odl.features.feature_builder import FeatureBuilder
from tests.harness import REPO, load_config_text

# (user, item, rating, unix time), deliberately not in time order; user 0 is not in u.user
RATINGS = [(2, 20, 5, 881250949), (1, 10, 3, 874965758), (1, 20, 4, 874965758),
           (0, 10, 5, 874000000), (2, 10, 1, 881251000), (1, 30, 2, 876893171)]
USERS = ["1|24|M|technician|85711", "2|53|F|other|94043"]
FLAGS = {10: [0, 0, 0, 1, 1] + [0] * 14, 20: [0] * 19, 30: [0, 1] + [0] * 16 + [1]}
ITEMS = [f"10|Toy Story (1995)|01-Jan-1995||http://x|{'|'.join(map(str, FLAGS[10]))}",
         f"20|Caf\xe9 (1994)|||http://x|{'|'.join(map(str, FLAGS[20]))}",
         f"30|Heat (1995)|15-Dec-1995||http://x|{'|'.join(map(str, FLAGS[30]))}"]


@pytest.fixture
def ml_dir(tmp_path):
    d = tmp_path / "ml-100k"
    d.mkdir()
    (d / "u.data").write_text("".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in RATINGS))
    (d / "u.user").write_text("\n".join(USERS) + "\n")
    (d / "u.item").write_bytes(("\n".join(ITEMS) + "\n").encode("latin-1"))
    return d


def test_ratings_come_in_time_order_with_their_labels_and_features(ml_dir):
    s = MovieLensStream(str(ml_dir))
    kept = sorted((t, n, u, i, r) for n, (u, i, r, t) in enumerate(RATINGS) if u != 0)
    assert s.dropped == 1 and len(s) == len(kept)
    rows = [dict(zip(MOVIELENS_COLUMNS, line.split(","), strict=True)) for line in s.lines]
    assert [(r["user_id"], r["item_id"]) for r in rows] == [(f"u{u}", f"i{i}")
                                                           for _t, _n, u, i, _r in kept]
    assert s.labels.tolist() == [int(r >= 4) for *_x, r in kept]
    assert [int(r["label"]) for r in rows] == s.labels.tolist()
    # the first rating at START_TIME, the gaps between ratings kept
    first = kept[0][0]
    assert [float(r["event_time"]) for r in rows] == [START_TIME + t - first
                                                      for t, *_x in kept]
    # hour and weekday of the rating's own time; user and movie attributes
    when = datetime.fromtimestamp(kept[0][0], tz=timezone.utc)
    assert rows[0]["hour"] == f"h{when.hour:02d}" and rows[0]["weekday"] == f"w{when.weekday()}"
    assert (rows[0]["age"], rows[0]["gender"], rows[0]["occupation"], rows[0]["zip3"]) == (
        "a2", "M", "technician", "857")
    by_item = {r["item_id"]: (r["genres"], r["year"]) for r in rows}
    assert by_item["i10"] == ("g3|g4", "y1995") and by_item["i20"] == ("g0", "y0")
    assert by_item["i30"] == ("g1|g18", "y1995")
    assert s.vw[0].startswith("-1 |u u1 a2 sM otechnician z857 |i i10 g3 g4 y1995 |c h")
    assert len(MovieLensStream(str(ml_dir), records=2)) == 2
    assert MovieLensStream(str(ml_dir), liked=5).labels.sum() == 1


def test_the_sample_config_reads_every_record_as_csv_and_json(ml_dir):
    config = load_config_text(open(f"{REPO}/samples/movielens_online.config",
                                   encoding="utf-8").read())
    assert [f.input_name for f in config.data_config.input_fields] == list(MOVIELENS_COLUMNS)
    fb = FeatureBuilder(config)
    s = MovieLensStream(str(ml_dir))
    batch = s.next_batch(100)
    assert len(batch.sample_ids) == len(s) and not s.next_batch(100).sample_ids
    for fmt in ("csv", "json"):
        built = fb.build(batch.encode(fmt))
        assert not built.rejected and built.batch.size == len(s)
        assert built.batch.labels.tolist() == s.labels.astype(float).tolist()
    rec = json.loads(batch.encode("json")[0])
    assert set(rec) == set(MOVIELENS_COLUMNS) and isinstance(rec["label"], int)


def test_the_later_archives_csv_layout_reads_the_same_way(tmp_path):
    """ml-latest-small's layout: ratings.csv with half stars and a header, movies.csv with
    quoted titles; no demographics (empty columns); the check config reads every record."""
    d = tmp_path / "ml-latest-small"
    d.mkdir()
    (d / "ratings.csv").write_text("userId,movieId,rating,timestamp\n"
                                   "7,3,4.5,1500000100\n7,1,3.5,1500000000\n"
                                   "9,2,4.0,1500000050\n9,99,5.0,1500000060\n")
    (d / "movies.csv").write_text(
        "movieId,title,genres\n1,Heat (1995),Action|Crime|Film-Noir\n"
        '2,"American President, The (1995)",Comedy|Drama|Romance\n'
        "3,Untitled,(no genres listed)\n")
    s = MovieLensStream(str(d))
    assert s.dropped == 1 and len(s) == 3  # movie 99 is not in movies.csv
    rows = [dict(zip(MOVIELENS_COLUMNS, line.split(","), strict=True)) for line in s.lines]
    assert [(r["user_id"], r["item_id"]) for r in rows] == [("u7", "i1"), ("u9", "i2"),
                                                           ("u7", "i3")]
    assert s.labels.tolist() == [0, 1, 1]  # 3.5, 4.0, 4.5 against liked = 4
    assert [(r["genres"], r["year"]) for r in rows] == [
        ("gAction|gCrime|gFilmNoir", "y1995"), ("gComedy|gDrama|gRomance", "y1995"),
        ("g0", "y0")]
    assert {(r["age"], r["gender"], r["occupation"], r["zip3"]) for r in rows} == {("",) * 4}
    assert s.vw[0].startswith("-1 |u u7 |i i1 gAction gCrime gFilmNoir y1995 |c h")
    config = load_config_text(open(f"{REPO}/bench/configs/movielens_latest_as_written.config",
                                   encoding="utf-8").read())
    built = FeatureBuilder(config).build(s.next_batch(10).encode("csv"))
    assert not built.rejected and built.batch.labels.tolist() == [0.0, 1.0, 1.0]


BENCH_CONFIGS = sorted(glob.glob(f"{REPO}/bench/configs/*.config"))


@pytest.mark.parametrize("path", BENCH_CONFIGS, ids=os.path.basename)
def test_the_bench_configs_train_unchanged_and_leave_in_batch_learning_to_the_stream(ml_dir,
                                                                                     path):
    """``--config-as-written`` runs these as fetched: they must load, read every MovieLens
    record and train with in-batch learning decided by the stream (no odl field)."""
    import numpy as np

    from odl.train.train_module import TrainModule

    config = load_config_text(open(path, encoding="utf-8").read())
    assert not config.train_config.HasField("in_batch_learning")
    fb = FeatureBuilder(config)
    s = MovieLensStream(str(ml_dir))
    built = fb.build(s.next_batch(100).encode("csv"))
    assert not built.rejected and built.batch.size == len(s)
    module = TrainModule(config, fb, device="cpu")
    for _ in range(2):
        probs = np.asarray(module.train_step(built.batch).probs)
        assert probs.shape == (len(s),) and np.all((probs > 0) & (probs < 1))
    status = module.in_batch_status()
    assert status["mode"] == "auto" and status["phase"] == "measuring"


def test_a_missing_file_names_where_to_get_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="MovieLens 100k"):
        MovieLensStream(str(tmp_path))


def test_datagen_cli_produces_every_rating_once_then_stops(ml_dir, kafka_bootstrap,
                                                           kafka_topic_factory, capsys):
    from odl.cli.datagen_cli import main
    from odl.harness.topic_records import read_messages

    topic = kafka_topic_factory(create=False)
    assert main(["--bootstrap", kafka_bootstrap, "--topic", topic, "--partitions", "1",
                 "--rate", "0", "--movielens", str(ml_dir), "-q"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    want = MovieLensStream(str(ml_dir))
    assert summary["produced"] == len(want) and summary["oracle_auc"] is None
    got = read_messages(kafka_bootstrap, topic, len(want))
    assert [v for v, _h in got] == want.values()
    assert main(["--bootstrap", kafka_bootstrap, "--topic", topic, "--movielens",
                 str(ml_dir / "nowhere"), "-q"]) == 2
    assert main(["--split-dir", str(ml_dir / "splits"), "--count", "5", "--movielens",
                 str(ml_dir)]) == 2
