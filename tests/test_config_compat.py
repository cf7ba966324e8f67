"""Real EasyRec / TorchEasyRec sample configs (``tests/compat_configs``, sources in its
``SOURCES.md``) with only their input section switched to ``kafka_train_input``.

Each must either load and validate, or be refused with a ``ConfigError`` naming a field (never
another exception); which ones load is pinned in ``LOADS``, the table in docs/config.md
("Compatibility with EasyRec and TorchEasyRec samples"). A config that starts to load, or stops,
fails here until both are updated.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

from tests.harness import REPO

_HERE = os.path.join(REPO, "tests", "compat_configs")
_spec = importlib.util.spec_from_file_location("compat_try_load",
                                               os.path.join(_HERE, "try_load.py"))
assert _spec is not None and _spec.loader is not None
try_load = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = try_load  # its dataclasses look their module up
_spec.loader.exec_module(try_load)

CONFIGS = sorted((flavor, name) for flavor in ("easyrec", "torcheasyrec")
                 for name in os.listdir(os.path.join(_HERE, flavor)) if name.endswith(".config"))

LOADS = {
    "easyrec/deepfm_combo_avazu_kafka.config",
    "easyrec/deepfm_combo_avazu_kafka_time_offset.config",
    "easyrec/deepfm_combo_on_avazu_ctr.config",
    "easyrec/deepfm_combo_on_avazu_embed_adagrad.config",
    "easyrec/dcn_on_taobao.config",
    "easyrec/dbmtl_on_taobao.config",
    "easyrec/dbmtl_mmoe_on_taobao.config",
    "easyrec/mmoe_on_taobao.config",
    "easyrec/multi_tower_on_taobao.config",
    "easyrec/wide_and_deep_on_avazau_ctr.config",
    "easyrec/wide_and_deep_two_opti.config",
    "easyrec/deepfm.config",
    "easyrec/deepfm_vocab_list_on_taobao.config",
    "easyrec/multi_tower_early_stop_on_taobao.config",
}


@pytest.mark.parametrize("flavor, name", CONFIGS, ids=[f"{f}/{n}" for f, n in CONFIGS])
def test_sample_config_loads_or_is_refused_by_field(flavor: str, name: str) -> None:
    _model_class, result, ok = try_load.try_one(os.path.join(_HERE, flavor, name), flavor,
                                                verbose=False)
    assert result == "OK" or result.startswith("ConfigError ["), result
    assert ok == (f"{flavor}/{name}" in LOADS), result


def test_the_corpus_is_what_sources_md_lists() -> None:
    with open(os.path.join(_HERE, "SOURCES.md"), encoding="utf-8") as f:
        sources = f.read()
    assert len(CONFIGS) >= 30
    for flavor, name in CONFIGS:
        assert f"`{flavor}/{name}`" in sources, name
