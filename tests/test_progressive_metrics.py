import numpy as np
import pytest

from odl.auc import roc_auc
from odl.train.progressive_metrics import ProgressiveMetrics, log_loss


def brute_auc(scores, labels):
    pos = scores[labels == 1]
    neg = scores[labels == 0]
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return wins / (len(pos) * len(neg))


def test_auc_matches_pairwise_definition_with_ties():
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 20, 500) / 20.0  # many ties
    labels = (rng.random(500) < 0.3).astype(int)
    assert roc_auc(labels, scores) == pytest.approx(brute_auc(scores, labels), abs=1e-12)


def test_auc_single_class_is_nan():
    assert np.isnan(roc_auc(np.array([1, 1]), np.array([0.1, 0.2])))


def test_window_keeps_only_the_latest_samples():
    m = ProgressiveMetrics(window=100)
    # first 1000 samples: anti-correlated; last 100: perfectly ranked
    m.update(np.linspace(0, 1, 1000), np.r_[np.ones(500), np.zeros(500)])
    m.update(np.r_[np.full(50, 0.2), np.full(50, 0.8)], np.r_[np.zeros(50), np.ones(50)])
    assert m.window_auc() == 1.0
    assert m.samples == 1100
    # the total view still sees the bad start
    assert m.total_auc() < 0.6


def test_window_wraps_around_in_small_updates():
    rng = np.random.default_rng(1)
    m = ProgressiveMetrics(window=256)
    probs, labels = rng.random(1000), (rng.random(1000) < 0.5).astype(float)
    for i in range(0, 1000, 37):
        m.update(probs[i : i + 37], labels[i : i + 37])
    assert m.window_auc() == pytest.approx(roc_auc(labels[-256:], probs[-256:]))
    assert m.window_logloss() == pytest.approx(log_loss(probs[-256:], labels[-256:]))


def test_total_auc_histogram_is_close_to_exact():
    rng = np.random.default_rng(2)
    labels = (rng.random(20000) < 0.25).astype(float)
    probs = 1 / (1 + np.exp(-(labels * 1.2 + rng.normal(size=20000))))
    m = ProgressiveMetrics(window=1000)
    m.update(probs, labels)
    assert m.total_auc() == pytest.approx(roc_auc(labels, probs), abs=2e-4)
    assert m.total_logloss() == pytest.approx(log_loss(probs, labels), rel=1e-9)


def test_window_gauc_is_the_grouped_auc_of_the_window_across_wraparound():
    from odl.auc import grouped_auc

    rng = np.random.default_rng(3)
    pm = ProgressiveMetrics(window=250, grouped=True)
    probs, labels, groups = [], [], []
    for size in (100, 120, 90, 250, 300, 30):  # fills, wraps, replaces the window whole
        p = np.round(rng.random(size), 2)
        y = (rng.random(size) < p).astype(float)
        g = rng.integers(0, 15, size)
        pm.update(p, y, g)
        probs.append(p)
        labels.append(y)
        groups.append(g)
        p_all, y_all, g_all = (np.concatenate(x)[-250:] for x in (probs, labels, groups))
        want = grouped_auc(y_all, p_all, g_all)
        assert pm.window_gauc() == pytest.approx(want, abs=1e-12)
        assert pm.summary()["gauc"] == pytest.approx(round(want, 6), abs=1e-6)
    assert "gauc" not in ProgressiveMetrics(window=10).summary()


def test_grouped_auc_averages_each_groups_auc_by_its_reduction():
    """EasyRec's reductions: plain mean (TorchEasyRec's too), by samples, by positives."""
    from odl.auc import grouped_auc, roc_auc

    y = np.array([1, 0, 0, 1, 1, 0, 0, 1, 1])
    s = np.array([0.9, 0.1, 0.5, 0.5, 0.3, 0.6, 0.55, 0.7, 0.2])
    g = np.array([1, 1, 1, 2, 2, 2, 2, 3, 3])  # group 3 has one class: left out
    a1 = roc_auc(y[:3], s[:3])
    a2 = roc_auc(y[3:7], s[3:7])
    assert a1 != a2
    assert grouped_auc(y, s, g) == pytest.approx((a1 + a2) / 2)
    assert grouped_auc(y, s, g, "mean_by_sample_num") == pytest.approx((3 * a1 + 4 * a2) / 7)
    assert grouped_auc(y, s, g, "mean_by_positive_num") == pytest.approx((a1 + 2 * a2) / 3)
    with pytest.raises(ValueError):
        grouped_auc(y, s, g, "median")


def test_easyrec_gauc_metric_sets_the_grouping_column_and_reduction():
    """EasyRec's eval_config.metrics_set { gauc { uid_field reduction } } (or a task
    tower's) asks for the same GAUC as TorchEasyRec's grouped_auc, with its reduction."""
    from odl.config.config_error import ConfigError
    from odl.config.metric_settings import grouped_auc_field, grouped_auc_reduction
    from odl.datagen.datagen_config import deepfm_config_text
    from odl.features.feature_builder import FeatureBuilder
    from odl.harness.model_configs import as_model_config_text
    from tests.harness import load_config_text, synthetic_records

    base = deepfm_config_text("/tmp/odl-gauc-unused", dim=8, buckets=50)
    text = base + ('\neval_config { metrics_set { auc {} } metrics_set { gauc { '
                   'uid_field: "C9" reduction: "mean_by_sample_num" } } }\n')
    config = load_config_text(text)
    assert grouped_auc_field(config) == "C9"
    assert grouped_auc_reduction(config) == "mean_by_sample_num"
    built = FeatureBuilder(config).build(synthetic_records(50)).batch
    assert built.group_keys is not None and built.group_keys.shape == (50,)
    assert grouped_auc_reduction(load_config_text(base)) == "mean"  # nothing asked
    bad = text.replace('"mean_by_sample_num"', '"median"')
    with pytest.raises(ConfigError) as e:
        load_config_text(bad)
    assert e.value.field == "eval_config.metrics_set[1].gauc.reduction"
    # a multi-task tower's metrics_set works the same; two reductions conflict
    mt = as_model_config_text(base, "MMoE").replace(
        'tower_name: "cvr" label_name: "buy"',
        'tower_name: "cvr" label_name: "buy" metrics_set { gauc { uid_field: "C9" } }')
    assert grouped_auc_reduction(load_config_text(mt)) == "mean"
    with pytest.raises(ConfigError) as e:
        load_config_text(mt + '\neval_config { metrics_set { gauc { uid_field: "C9" '
                              'reduction: "mean_by_positive_num" } } }\n')
    assert "one GAUC reduction per model" in str(e.value)
