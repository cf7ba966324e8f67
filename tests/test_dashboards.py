"""The dashboards: the pages of a running trainer and serving, their history, and the
Grafana dashboard and alert rules over ``/metrics``.

A real ``odl-train --online`` (publishing to a delta topic, bearer token set) trains on a
stream that keeps arriving, and a real ``odl-serve`` replays its versions. Checked:

* the history keeps recent points and folds older ones into bounded means;
* every metric ``docs/grafana/`` uses exists in the two daemons' ``/metrics``;
* in Debian's chromium (selenium with chromedriver): without the token the trainer's page
  shows the token field and no figures; with it the charts draw points of the live stream
  and gain new ones within seconds; serving's page draws its version and ``/predict``
  latency. Without chromium, chromedriver or selenium the browser test is skipped and says
  so (``make test`` installs chromium as root on Debian; elsewhere
  ``apt-get install chromium chromium-driver``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import yaml

from odl.checkpoint.checkpoint_manager import list_checkpoints
from odl.config.pipeline_config import load_pipeline_config
from odl.export.exporter import export_checkpoint
from odl.harness.http_client import free_port, http_request
from odl.harness.topic_records import delete_topics, make_records, produce
from odl.harness.trainer_process import start_cli_trainer, trainer_url
from odl.http.metric_history import MetricHistory
from odl.kafka.topic_admin import create_topic
from odl.train.trainer_dashboard import TRAINER_LAYOUT
from odl.train.trainer_dashboard import history_point as trainer_history_point
from serving_plugin.serving_dashboard import history_point as serving_history_point
from tests.harness import write_config

REPO = Path(__file__).resolve().parents[1]
GRAFANA = REPO / "docs" / "grafana"
TOKEN = "dash-" + uuid.uuid4().hex[:12]


def test_history_keeps_recent_points_and_folds_older_ones_into_means():
    h = MetricHistory(interval_s=1.0, fine_span_s=20.0, coarse_step_s=10.0,
                      coarse_span_s=60.0)
    for t in range(0, 200):
        h.record({"x": float(t), "odd": 1.0 if t % 2 else None}, t=1000.0 + t)
    pts = h.points()
    fine = [(t, p) for t, p in pts if t >= 1000.0 + 199 - 20]
    assert [p["x"] for _, p in fine] == [float(t) for t in range(179, 200)]
    coarse = [(t, p) for t, p in pts if t < 1000.0 + 179]
    # 10 s buckets of the last 60 s before the fine span, each the mean of its points (the
    # newest still filling: 170..178); a figure missing from some points: the others' mean
    assert [(t, p["x"], p["odd"]) for t, p in coarse] == [
        (1145.0, 144.5, 1.0), (1155.0, 154.5, 1.0), (1165.0, 164.5, 1.0), (1175.0, 174.0, 1.0)]
    doc = h.to_json(since=1000.0 + 195)
    assert doc["t"] == [1196.0, 1197.0, 1198.0, 1199.0]
    assert doc["series"]["x"] == [196.0, 197.0, 198.0, 199.0]
    assert doc["series"]["odd"] == [None, 1.0, None, 1.0]


def test_history_points_name_every_figure_the_pages_draw():
    """A trainer's and a serving status document become the flat figures the charts name
    (a partition without a watermark yet has no lag; unknown values are left out)."""
    status = {
        "progressive": {"auc": 0.71, "logloss": 0.4, "auc_total": 0.7, "logloss_total": 0.41},
        "tasks": {"ctr": {"auc": 0.7, "logloss": 0.3}},
        "passes": {"passes": [{"auc": 0.69, "logloss": 0.5}]},
        "evaluation": {"auc": 0.68, "logloss": 0.45},
        "samples_per_sec": 1000.0, "loss": 0.4, "global_step": 12,
        "input": {"partitions": {"0": {"lag": 5}, "1": {"lag": None}}},
        "publisher": {"last_version": 12, "last_publish_time": 990.0, "failures": 1},
        "last_checkpoint": {"step": 10, "time": 900.0, "error": "disk full"},
        "records_rejected": {"bad_label": 3},
        "dynamic_tables": {"user": {"live_rows": 42}},
    }
    point = trainer_history_point(status, now=1000.0)
    assert point["auc.task.ctr"] == 0.7 and point["auc.pass"] == 0.69
    assert point["auc.eval"] == 0.68 and point["lag.0"] == 5 and point["lag.1"] is None
    assert point["lag_total"] == 5 and point["published_age_s"] == 10.0
    assert point["checkpoint_age_s"] == 100.0 and point["checkpoint_error"] == 1.0
    assert point["rejects.bad_label"] == 3 and point["rows.user"] == 42
    names = {s for c in TRAINER_LAYOUT.charts for s in c.series}
    for figure in point:  # every figure is drawn by some chart (or is the step count)
        assert figure in names or any(n.endswith("*") and figure.startswith(n[:-1])
                                      for n in names) or figure in ("loss", "global_step")
    served = serving_history_point(
        {"version": 7, "freshness_seconds": 1.5, "last_version_publish_time": 999.0,
         "lag_messages": 0, "rejected_by_reason": {"bad_crc": 2}},
        {"rate": 3.0, "p50_ms": 1.2, "p99_ms": 4.0}, now=1000.0)
    assert served == {"version": 7.0, "freshness_s": 1.5, "publish_age_s": 1.0,
                      "lag_messages": 0.0, "predict_rate": 3.0, "predict_p50_ms": 1.2,
                      "predict_p99_ms": 4.0, "rejected.bad_crc": 2.0}


def _get(url: str):
    return http_request(url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)


def _wait(cond, what: str, secs: float = 120.0):
    deadline = time.monotonic() + secs
    while time.monotonic() < deadline:
        try:
            value = cond()
        except OSError:  # a server not listening yet
            value = None
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def daemons(kafka_bootstrap, tmp_path_factory):
    """A trainer on a live stream and serving on its versions: ``(trainer url, serving url)``."""
    tmp = tmp_path_factory.mktemp("dashboards")
    topic, delta = f"odl-test-dash-{uuid.uuid4().hex[:8]}", f"odl-test-dd-{uuid.uuid4().hex[:8]}"
    create_topic(kafka_bootstrap, topic, 2)
    incr = (f"incr_save_config {{ sparse_save_steps: 2 dense_save_steps: 2 "
            f'kafka {{ server: "{kafka_bootstrap}" topic: "{delta}" }} }}')
    cfg = write_config(tmp, kafka_bootstrap, topic, batch_size=64, extra_train=incr,
                       save_checkpoints_steps=20)
    model_dir = str(tmp / "model_dir")
    stop = threading.Event()

    def feed() -> None:  # a stream that keeps arriving while the tests look
        for k in range(400):
            produce(kafka_bootstrap, topic, make_records(100, seed=k)[1], 2)
            if stop.wait(0.4):
                return

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    env_token = {**os.environ, "ODL_AUTH_TOKEN": TOKEN}
    trainer = start_cli_trainer(cfg, str(tmp / "trainer.log"), "--dashboard_interval_s",
                                "0.5", "--log_level", "WARNING", env=env_token)
    serve = None
    try:
        url = _wait(lambda: trainer_url(model_dir, trainer.pid), "the trainer's status API")
        _wait(lambda: list_checkpoints(model_dir), "the base checkpoint")
        export_checkpoint(load_pipeline_config(cfg), list_checkpoints(model_dir)[0],
                          str(tmp / "export"))
        port = free_port()
        serve = subprocess.Popen([sys.executable, "-m", "odl.cli.serve_cli", "--export_dir",
                                  str(tmp / "export"), "--port", str(port)], cwd=REPO,
                                 env=env_token, stdout=open(tmp / "serve.log", "ab"),
                                 stderr=subprocess.STDOUT)
        serving = f"http://127.0.0.1:{port}"
        _wait(lambda: (_get(serving + "/status").status == 200
                       and _get(serving + "/status").json().get("versions_applied")),
              "serving to apply a version")
        yield url, serving
    finally:
        stop.set()
        for proc in (trainer, serve):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
        delete_topics(kafka_bootstrap, [topic, delta])


def _used_metrics() -> set[str]:
    """Metric names in the Grafana dashboard's queries and the alert rules' expressions."""
    exprs = [t["expr"] for p in json.loads((GRAFANA / "odl-dashboard.json").read_text())["panels"]
             for t in p.get("targets", [])]
    rules = yaml.safe_load((GRAFANA / "odl-alerts.yml").read_text())
    exprs += [r["expr"] for g in rules["groups"] for r in g["rules"]]
    names = set()
    for e in exprs:
        names |= {m for m in re.findall(r"[a-z_]+", e) if m.startswith("odl_")}
    return names


def test_every_metric_of_the_grafana_dashboard_and_alerts_exists(daemons):
    trainer, serving = daemons
    exposed = set()
    for url in (trainer, serving):
        text = _get(url + "/metrics").body.decode()
        exposed |= set(re.findall(r"^# TYPE (\S+)", text, flags=re.M))
        exposed |= {m.split("{")[0].split(" ")[0] for m in text.splitlines()
                    if m and not m.startswith("#")}
    used = _used_metrics()
    assert "odl_healthy" in used and "odl_serving_freshness_seconds" in used
    missing = {m for m in used if m not in exposed
               and re.sub(r"_(total|bucket|sum|count)$", "", m) not in exposed}
    assert missing == set(), missing
    assert "odl_healthy 1.0" in _get(trainer + "/metrics").body.decode()


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool is not installed (apt-get install prometheus)")
def test_alert_rules_pass_promtool():
    res = subprocess.run(["promtool", "check", "rules", str(GRAFANA / "odl-alerts.yml")],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def _browser():
    missing = [name for name in ("chromium", "chromedriver") if shutil.which(name) is None]
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        missing.append("selenium (pip)")
    if missing:
        pytest.skip(f"no {', '.join(missing)}: `make test` installs chromium and "
                    "chromium-driver as root on Debian; elsewhere install them to run this")
    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"):
        opts.add_argument(flag)
    return webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)


def _points(driver, chart: str) -> int:
    el = driver.find_element("css selector", f'svg[data-chart="{chart}"]')
    return int(el.get_attribute("data-points") or 0)


def test_pages_in_a_real_browser_ask_for_the_token_then_draw_the_live_stream(daemons):
    trainer, serving = daemons
    driver = _browser()
    try:
        driver.get(trainer + "/")
        login = _wait(lambda: driver.find_element("id", "login").is_displayed() or None,
                      "the token field", 20)
        assert login
        assert not driver.find_element("id", "main").is_displayed()
        assert driver.find_elements("css selector", "polyline") == []
        driver.find_element("id", "token").send_keys(TOKEN)
        driver.find_element("css selector", "#login button").click()
        _wait(lambda: driver.find_element("id", "main").is_displayed(), "the page", 20)
        first = _wait(lambda: _points(driver, "Training rate"), "points of the stream", 30)
        assert _points(driver, "Progressive AUC") > 0 and _points(driver, "Lag") > 0
        state = driver.find_element("id", "head").text
        assert "state: training" in state or "state: waiting" in state, state
        _wait(lambda: _points(driver, "Training rate") > first, "new points", 15)

        records = b"\n".join(make_records(20, seed=999)[1])
        for _ in range(5):
            post = http_request(serving + "/predict", method="POST", body=records,
                                headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
            assert post.status == 200
        driver.get(serving + "/")  # another origin (port): it asks for the token again
        _wait(lambda: driver.find_element("id", "login").is_displayed(), "its token field", 20)
        driver.find_element("id", "token").send_keys(TOKEN)
        driver.find_element("css selector", "#login button").click()
        _wait(lambda: driver.find_element("id", "main").is_displayed(), "serving's page", 20)
        _wait(lambda: _points(driver, "Version"), "serving's versions", 30)
        _wait(lambda: _points(driver, "/predict latency"), "the /predict latency", 30)
    finally:
        driver.quit()


def test_the_open_page_holds_no_figure(daemons):
    """The open page itself carries no figure: the status values are nowhere in it."""
    trainer, _ = daemons
    page = http_request(trainer + "/", timeout=10)
    assert page.status == 200
    status = _get(trainer + "/status").json()
    assert status["generation"] not in page.body.decode()
    assert http_request(trainer + "/history", timeout=10).status == 401
