"""``odl-datagen``: produce the synthetic CTR stream to a Kafka topic, or write it as files.

With ``--split-dir DIR`` it writes a PaddleRec-style file stream instead
(``DIR/YYYYMMDD/HHMM/part-*`` and a donefile per split, ``odl.datagen.split_writer``) for
``file_stream_input``: ``--day``, ``--start``, ``--splits``, ``--split-interval``,
``--count`` records per split, ``--parts``, ``--donefile``; it prints one JSON summary line.

Message layout (the value formats are described in ``odl.datagen.synthetic_ctr``):

* key: the record's ``sample_id`` (UTF-8);
* value: the record encoded as ``csv`` (42 comma separated columns, no header) or ``json``;
  with ``--conversions`` a 43rd column / key ``buy``, the conversion label of the multi-task
  samples (``odl.datagen.conversion_labels``); with ``--history`` a 43rd column / key
  ``hist_C3``, the behaviour sequence of the DIN sample (``odl.datagen.behavior_history``);
  with ``--bursty`` the 8 columns of ``odl.datagen.bursty_stream`` instead (event times are
  the stream's simulated session times, from 2026-01-01T00:00:00Z); with ``--movielens DIR``
  the 13 columns of ``odl.datagen.movielens_stream`` (MovieLens 100k's ratings in time
  order, event times moved to start at 2026-01-01T00:00:00Z; it stops after the last
  rating, ``oracle_auc`` is null);
* partition: record number ``n % partitions`` (round robin);
* timestamp: the produce time in ms (CreateTime), set explicitly.

The rate is kept in small bursts (every 10 ms). Progress goes to the log (stderr); at the end,
also after SIGTERM/SIGINT, one JSON line goes to stdout::

    {"topic": "t", "produced": 1000, "first_event_time": 1767225600.0,
     "last_event_time": 1767225600.1, "oracle_auc": 0.786, "positive_rate": 0.25,
     "delivery_errors": 0, "seconds": 0.4}

Exit codes: 0 ok, 1 delivery errors, 2 bad arguments or broker/topic problems.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer

from odl.datagen.behavior_history import HISTORY_FIELD
from odl.datagen.bursty_stream import BurstyStream
from odl.datagen.conversion_labels import CONVERSION_FIELD
from odl.datagen.datagen_config import records_with_column
from odl.datagen.movielens_stream import MovieLensStream
from odl.datagen.split_writer import write_splits
from odl.datagen.synthetic_ctr import FORMATS, SyntheticCtrStream
from odl.kafka.client_settings import producer_config, redact_settings
from odl.kafka.topic_admin import TopicAdminError, create_topic, list_topics

logger = logging.getLogger(__name__)

TICK_S = 0.01
UNLIMITED_BURST = 2000
PROGRESS_EVERY_S = 5.0


class _Delivery:
    """Counts delivery reports."""

    def __init__(self) -> None:
        self.delivered = 0
        self.errors = 0
        self.first_error: str | None = None

    def __call__(self, err: KafkaError | None, _msg: Any) -> None:
        if err is None:
            self.delivered += 1
            return
        self.errors += 1
        if self.first_error is None:
            self.first_error = str(err)
            logger.error("delivery failed: %s", err)


def parse_kafka_config(items: list[str] | None) -> dict[str, str]:
    """Parses ``key=value`` strings into a dict.

    Raises:
        ValueError: an item has no ``=``.
    """
    conf: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--kafka-config expects key=value, got {item!r}")
        conf[key.strip()] = value
    return conf


def build_parser() -> argparse.ArgumentParser:
    """The ``odl-datagen`` argument parser."""
    p = argparse.ArgumentParser(
        prog="odl-datagen", description="Produce a synthetic CTR stream with a known answer."
    )
    p.add_argument("--bootstrap", help="Kafka bootstrap servers host:port[,..] (required "
                   "unless --split-dir)")
    p.add_argument("--topic", help="the topic (required unless --split-dir)")
    files = p.add_argument_group("file stream (instead of Kafka)")
    files.add_argument("--split-dir", help="write DIR/YYYYMMDD/HHMM/part-* splits instead")
    files.add_argument("--day", default="", help="first day, YYYYMMDD (default: today, UTC)")
    files.add_argument("--start", default="0000", help="first split, HHMM")
    files.add_argument("--splits", type=int, default=4, help="splits to write")
    files.add_argument("--split-interval", type=int, default=5, help="minutes between splits")
    files.add_argument("--parts", type=int, default=2, help="files per split")
    files.add_argument("--donefile", default="to.hadoop.done",
                       help="completion marker written last in each split ('' for none)")
    p.add_argument(
        "--partitions",
        type=int,
        default=4,
        help="partitions when creating a missing topic (0: the topic must exist)",
    )
    p.add_argument("--rate", type=float, default=10000.0, help="samples/s (0 = unlimited)")
    stop = p.add_mutually_exclusive_group()
    stop.add_argument("--seconds", type=float, help="stop after this many seconds")
    stop.add_argument("--count", type=int, help="stop after this many samples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--format", choices=FORMATS, default="csv")
    extra = p.add_mutually_exclusive_group()
    extra.add_argument("--conversions", action="store_true",
                       help="add a 'buy' label column after the 42 (multi-task samples: "
                            "samples/mmoe_online.config, samples/dbmtl_online.config)")
    extra.add_argument("--history", action="store_true",
                       help="add a 'hist_C3' behaviour-sequence column after the 42 (DIN "
                            "sample: samples/din_online.config)")
    extra.add_argument("--bursty", action="store_true",
                       help="the bursty user-item stream instead (8 columns; sessions, new "
                            "users and items, odl.datagen.bursty_stream; sample: "
                            "samples/bursty_online.config); Kafka only")
    extra.add_argument("--movielens", metavar="DIR", default="",
                       help="MovieLens 100k's ratings in time order instead (13 columns; DIR: "
                            "the unpacked ml-100k directory, or ml-latest-small's with "
                            "ratings.csv and movies.csv; not shipped; "
                            "odl.datagen.movielens_stream; sample: "
                            "samples/movielens_online.config); Kafka only")
    p.add_argument(
        "--kafka-config",
        nargs="+",
        action="extend",
        default=[],
        metavar="K=V",
        help="extra librdkafka settings",
    )
    p.add_argument(
        "--timeout", type=float, default=30.0, help="seconds to wait for the broker/topic"
    )
    p.add_argument("-q", "--quiet", action="store_true", help="log warnings only")
    return p


def _extra_column(args: argparse.Namespace) -> str:
    """The column written after the stream's 42 (``records_with_column``), or ``""``."""
    if args.conversions:
        return CONVERSION_FIELD
    return HISTORY_FIELD if args.history else ""


def _install_stop_handlers(stop: threading.Event) -> dict[int, Any]:
    previous: dict[int, Any] = {}
    if threading.current_thread() is not threading.main_thread():
        return previous
    for sig in (signal.SIGTERM, signal.SIGINT):
        previous[sig] = signal.signal(sig, lambda signum, _frame: stop.set())
    return previous


def _topic_partitions(args: argparse.Namespace, extra: dict[str, str]) -> int:
    if args.partitions > 0:
        return create_topic(
            args.bootstrap, args.topic, args.partitions, timeout=args.timeout, extra=extra
        )
    topics = list_topics(args.bootstrap, timeout=args.timeout, extra=extra)
    if args.topic not in topics:
        raise TopicAdminError(f"topic {args.topic!r} does not exist (and --partitions is 0)")
    return topics[args.topic]


def run(args: argparse.Namespace, stop: threading.Event) -> dict[str, Any]:
    """Produces until the count, the time limit or ``stop``; returns the summary."""
    stream: SyntheticCtrStream | BurstyStream | MovieLensStream
    if args.movielens:
        stream = MovieLensStream(args.movielens)
    elif args.bursty:
        stream = BurstyStream(seed=args.seed)
    else:
        stream = SyntheticCtrStream(seed=args.seed)
    extra = parse_kafka_config(args.kafka_config)
    partitions = _topic_partitions(args, extra)
    conf = producer_config(args.bootstrap, extra)
    logger.info("producer settings: %s", redact_settings(conf))
    producer = Producer(conf)
    delivery = _Delivery()
    rate = float(args.rate)
    min_burst = max(1, int(rate * TICK_S)) if rate > 0 else UNLIMITED_BURST
    max_burst = max(min_burst, int(rate * 0.1)) if rate > 0 else UNLIMITED_BURST
    count = args.count
    topic = args.topic
    first_time: float | None = None
    last_time: float | None = None
    n = 0
    start = time.monotonic()
    next_log = start + PROGRESS_EVERY_S
    last_log_n, last_log_t = 0, start
    logger.info(
        "producing to %s (%d partitions) at %s samples/s, format %s, seed %d",
        topic,
        partitions,
        rate if rate > 0 else "max",
        args.format,
        args.seed,
    )
    while not stop.is_set():
        now = time.monotonic()
        elapsed = now - start
        if args.seconds is not None and elapsed >= args.seconds:
            break
        if count is not None and n >= count:
            break
        burst = max_burst
        if rate > 0:
            due = int(rate * elapsed) - n
            if due < min_burst and (count is None or count - n > due):
                wait = (n + min_burst) / rate - elapsed
                producer.poll(min(max(wait, 0.0), TICK_S))
                continue
            burst = min(max(due, 1), max_burst)
        if count is not None:
            burst = min(burst, count - n)
        if isinstance(stream, (BurstyStream, MovieLensStream)):  # the stream's own times
            batch = stream.next_batch(burst)
            values = batch.encode(args.format)
            if not values:  # the ratings are all produced
                break
            burst = len(values)
        else:
            batch = stream.next_batch(burst, now=time.time())
            values = records_with_column(_extra_column(args), stream, batch, args.format)
        timestamp_ms = int(time.time() * 1000)
        for i, (key, value) in enumerate(zip(batch.sample_ids, values, strict=True)):
            while True:
                try:
                    producer.produce(
                        topic,
                        value=value,
                        key=key.encode(),
                        partition=(n + i) % partitions,
                        timestamp=timestamp_ms,
                        on_delivery=delivery,
                    )
                    break
                except BufferError:
                    producer.poll(0.05)
        if first_time is None:
            first_time = float(batch.event_times[0])
        last_time = float(batch.event_times[-1])
        n += burst
        producer.poll(0)
        if now >= next_log:
            logger.info(
                "produced %d (%.0f/s recent, %.0f/s overall), delivered %d, errors %d",
                n,
                (n - last_log_n) / max(now - last_log_t, 1e-9),
                n / max(elapsed, 1e-9),
                delivery.delivered,
                delivery.errors,
            )
            last_log_n, last_log_t = n, now
            next_log = now + PROGRESS_EVERY_S
    if stop.is_set():
        logger.info("stop requested; flushing %d produced samples", n)
    remaining = producer.flush(30.0)
    if remaining:
        logger.error("%d messages still undelivered after 30 s flush", remaining)
    seconds = time.monotonic() - start
    errors = delivery.errors + remaining
    logger.info(
        "done: %d produced, %d delivered, %d errors in %.1fs (%.0f/s)",
        n,
        delivery.delivered,
        errors,
        seconds,
        n / max(seconds, 1e-9),
    )
    return {
        "topic": topic,
        "produced": delivery.delivered,
        "first_event_time": first_time,
        "last_event_time": last_time,
        "oracle_auc": (round(oracle, 6) if n and (oracle := stream.oracle_auc()) is not None
                       else None),
        "positive_rate": round(stream.positive_rate(), 6) if n else None,
        "delivery_errors": errors,
        "seconds": round(seconds, 3),
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``odl-datagen``.

    Args:
        argv: arguments without the program name (default: ``sys.argv[1:]``).

    Returns:
        0 on success, 1 on delivery errors, 2 on bad arguments or broker/topic errors.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.split_dir:
        if args.bursty or args.movielens:
            print("odl-datagen: error: --bursty and --movielens produce to Kafka only (no "
                  "--split-dir)", file=sys.stderr)
            return 2
        if args.count is None or args.count <= 0 or args.splits <= 0 or args.parts <= 0:
            print("odl-datagen: error: --split-dir needs --count (records per split) > 0, "
                  "--splits > 0 and --parts > 0", file=sys.stderr)
            return 2
        day = args.day or time.strftime("%Y%m%d", time.gmtime())
        try:
            summary = write_splits(args.split_dir, day, args.splits, args.count,
                                   args.split_interval, args.start, args.parts, args.donefile,
                                   args.seed, args.format, _extra_column(args))
        except (ValueError, OSError) as exc:
            print(f"odl-datagen: error: {exc}", file=sys.stderr)
            return 2
        print(json.dumps(summary), flush=True)
        return 0
    if not args.bootstrap or not args.topic:
        print("odl-datagen: error: --bootstrap and --topic are required (or --split-dir)",
              file=sys.stderr)
        return 2
    if args.rate < 0 or (args.count is not None and args.count < 0) or args.partitions < 0:
        print("odl-datagen: error: --rate, --count and --partitions must be >= 0", file=sys.stderr)
        return 2
    stop = threading.Event()
    previous = _install_stop_handlers(stop)
    try:
        summary = run(args, stop)
    except (TopicAdminError, KafkaException, ValueError, OSError) as exc:
        print(f"odl-datagen: error: {exc}", file=sys.stderr)
        return 2
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print(json.dumps(summary), flush=True)
    return 1 if summary["delivery_errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
