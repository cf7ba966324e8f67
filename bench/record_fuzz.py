"""Hostile records through the whole online loop: trained once xor dead-lettered once.

One run, everything real and local:

* an embedded broker of its own; a sample topic with ``--partitions`` partitions;
* ``--records`` records from ``odl.datagen.hostile_records.hostile_stream`` (a
  ``--hostile-fraction`` share of them hostile: invalid UTF-8, lone surrogates, extreme and
  non-finite numbers, huge fields, wrong field counts, empty and bad labels, absurd event
  times, JSON of the wrong shape, raw bytes), produced before the trainer starts;
* ``odl-train --online`` as a subprocess with a Kafka delta topic (versions every 5 steps),
  a dead-letter topic, the input process and ``--sample_ledger``; stopped with
  ``OSS_STOP_SIGNAL`` once ``/offsets`` reaches the topic's end.

Checks and figures: the trainer's exit code (0) and that it never restarted; every record is
in the sample ledger (by sample id) or on the dead-letter topic (by source position), never
both, never twice, never missing; the final checkpoint's positions equal the topic's end;
publisher failures and fatal errors (0); records/s through the loop; dead letters by reason.

    .venv/bin/python bench/record_fuzz.py [--records 120000] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from confluent_kafka import Consumer, TopicPartition  # noqa: E402

from bench.run_output import add_output_args, finish_run  # noqa: E402
from odl.broker.embedded_broker import EmbeddedBroker  # noqa: E402
from odl.checkpoint.checkpoint_manager import list_checkpoints, read_checkpoint  # noqa: E402
from odl.datagen.datagen_config import deepfm_config_text  # noqa: E402
from odl.datagen.hostile_records import hostile_stream  # noqa: E402
from odl.harness.topic_records import produce  # noqa: E402
from odl.harness.trainer_process import start_cli_trainer, trainer_json  # noqa: E402
from odl.inputs.dead_letter import REASON_HEADER, SOURCE_HEADER  # noqa: E402
from odl.kafka.client_settings import consumer_config  # noqa: E402
from odl.kafka.topic_admin import create_topic, end_offsets  # noqa: E402
from odl.train.sample_ledger import read_ledger  # noqa: E402


def read_dead_letters(bootstrap: str, topic: str, n: int) -> list[dict]:
    """Headers of the first ``n`` dead letters."""
    consumer = Consumer(consumer_config(bootstrap, "odl-bench-fuzz-dlq"))
    consumer.assign([TopicPartition(topic, 0, 0)])
    out: list[dict] = []
    deadline = time.time() + 120
    while len(out) < n and time.time() < deadline:
        for msg in consumer.consume(1000, timeout=0.5):
            if msg.error() is None:
                out.append({k: v for k, v in msg.headers() or []})
    consumer.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=120_000)
    ap.add_argument("--hostile-fraction", type=float, default=0.3)
    ap.add_argument("--partitions", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--seed", type=int, default=20261123)
    ap.add_argument("--huge-kb", type=int, nargs="+",
                    default=[8] * 30 + [16] * 10 + [64] * 4 + [1100],
                    help="sizes (KiB) a huge_field record's field is drawn from, uniformly "
                         "(1100: over the 1 MiB record limit; the default keeps the backlog "
                         "near 200 MB for 120k records)")
    ap.add_argument("--timeout", type=float, default=1800)
    add_output_args(ap)
    args = ap.parse_args()

    work = tempfile.mkdtemp(prefix="odl-bench-fuzz-")
    broker = EmbeddedBroker(port=0, data_dir=os.path.join(work, "kafka")).start()
    proc = None
    try:
        bs = broker.bootstrap
        topic, delta, dlq = "fuzz", "fuzz-deltas", "fuzz-dead-letters"
        create_topic(bs, topic, args.partitions, config={"max.message.bytes": str(4 << 20)})
        t0 = time.monotonic()
        records = list(hostile_stream(args.records, args.seed, args.hostile_fraction,
                                      huge_field_bytes=tuple(k << 10 for k in args.huge_kb)))
        values = [v for _, _, v in records]
        where = produce(bs, topic, values, args.partitions, config={
            "linger.ms": "20", "queue.buffering.max.kbytes": "262144",
            "message.max.bytes": str(4 << 20)}, flush_timeout=300)
        ends = end_offsets(bs, topic)
        print(f"produced {len(values):,} records ({sum(map(len, values)) / 2**20:.0f} MiB, "
              f"{sum(k != 'good' for _, k, _ in records):,} hostile) in "
              f"{time.monotonic() - t0:.1f}s", flush=True)

        model_dir = os.path.join(work, "model_dir")
        incr = (f'incr_save_config {{ sparse_save_steps: 5 dense_save_steps: 5 kafka {{ server: '
                f'"{bs}" topic: "{delta}" }} }}')
        text = deepfm_config_text(model_dir, server=bs, topic=topic, batch_size=args.batch_size,
                                  extra_train=incr, save_checkpoints_steps=100)
        text = text.replace('  event_time_field: "event_time"',
                            f'  event_time_field: "event_time"\n  dead_letter_topic: "{dlq}"')
        cfg = os.path.join(work, "pipeline.config")
        with open(cfg, "w") as f:
            f.write(text)
        ledger = os.path.join(work, "ledger.tsv")
        log_path = os.path.join(work, "trainer.log")
        proc = start_cli_trainer(cfg, log_path, "--sample_ledger", ledger)
        t_start = time.monotonic()
        deadline = t_start + args.timeout
        last: dict = {}
        next_print = time.monotonic() + 10
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"trainer exited early with {proc.returncode}; see {log_path}")
            off = trainer_json(model_dir, "/offsets", timeout=10)
            status = trainer_json(model_dir, "/status", timeout=10)
            if status is not None:
                last = status
            if off is not None:
                pos = {int(k): v for k, v in off["positions"].items()}
                done = sum(min(pos.get(p, 0), e) for p, e in ends.items())
                if time.monotonic() >= next_print:
                    next_print += 10
                    print(f"  {done:,}/{len(values):,} records, "
                          f"{last.get('samples_per_sec', 0):,.0f} samples/s", flush=True)
                if pos and all(pos.get(p, 0) >= e for p, e in ends.items()):
                    break
            time.sleep(0.5)
        else:
            raise RuntimeError("the trainer did not reach the topic's end in time")
        drain = time.monotonic() - t_start
        last = trainer_json(model_dir, "/status", timeout=10) or last
        Path(model_dir, "OSS_STOP_SIGNAL").touch()
        rc = proc.wait(timeout=300)

        sid_index = {sid: i for i, (sid, _, _) in enumerate(records)}
        trained = [sid_index.get(sid, -1) for _, _, sid in read_ledger(ledger)]
        rejected = last.get("records_rejected", {})
        letters = read_dead_letters(bs, dlq, sum(rejected.values()))
        src = {f"{topic}/{p}/{o}": i for i, (p, o) in enumerate(where)}
        lettered = [src.get(h.get(SOURCE_HEADER, b"").decode(), -1) for h in letters]
        count = collections.Counter(trained + lettered)
        lost = sum(1 for i in range(len(records)) if count[i] == 0)
        twice = sum(1 for i, c in count.items() if c > 1 and i >= 0)
        both = len(set(trained) & set(lettered))
        ckpt = read_checkpoint(list_checkpoints(model_dir)[-1])
        pub = last.get("publisher") or {}
        reasons = collections.Counter(h.get(REASON_HEADER, b"?").decode() for h in letters)
        by_kind: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        trained_set, letter_reason = set(trained), {}
        for h, i in zip(letters, lettered, strict=True):
            letter_reason[i] = h.get(REASON_HEADER, b"?").decode()
        for i, (_, kind, _) in enumerate(records):
            by_kind[kind]["trained" if i in trained_set else letter_reason.get(i, "lost")] += 1
        result = {
            "records": len(records),
            "hostile": sum(k != "good" for _, k, _ in records),
            "trained": len(trained),
            "dead_lettered": len(letters),
            "lost": lost,
            "twice": twice,
            "trained_and_dead_lettered": both,
            "unknown_trained_ids": trained.count(-1),
            "exit_code": rc,
            "positions_equal_end": ckpt.positions == ends,
            "drain_seconds": round(drain, 1),
            "records_per_sec": round(len(records) / drain, 1),
            "publisher_failures": pub.get("failures"),
            "publisher_fatal_error": pub.get("fatal_error"),
            "versions_published": pub.get("versions_published"),
            "dead_letters_by_reason": dict(sorted(reasons.items())),
            "outcome_by_kind": {k: dict(sorted(c.items())) for k, c in sorted(by_kind.items())},
        }
        print(json.dumps(result, indent=1))
        ok = (rc == 0 and lost == 0 and twice == 0 and both == 0 and result["positions_equal_end"]
              and not trained.count(-1) and pub.get("failures") == 0
              and pub.get("fatal_error") is None)
        print("OK: every record trained once or dead-lettered once" if ok else "FAILED")
        finish_run(args, result, work)
        return 0 if ok else 1
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        broker.stop()


if __name__ == "__main__":
    sys.exit(main())
