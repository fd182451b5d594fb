"""Routing regimes of the synthetic MoE writers (mlx_flash.tools.synthetic, synthetic_gguf) measured with
mlx_flash.tools.routing on random tokens: uniform routes near-uniformly and independently, own is sticky,
skewed lies between; the LRU and cold / steady hit-rate arithmetic."""

from mlx_flash.convert import convert
from mlx_flash.format.directory import FlashDir
from mlx_flash.tools.routing import lru_hit_rates, record, regime_of, routing_stats, split_hit_rate
from mlx_flash.tools.synthetic import build
from mlx_flash.tools.synthetic_gguf import tiny_moe, write_gguf

import numpy as np
import pytest

E, K = 16, 2
SHAPE = dict(tiny_moe("qwen3_moe"), num_hidden_layers=8, num_experts=E, num_experts_per_tok=K)


@pytest.fixture(scope="module")
def regimes(tmp_path_factory):
    root = tmp_path_factory.mktemp("routing")
    out = {}
    for routing in ("own", "uniform", "skewed"):
        gguf = write_gguf("moe-small", root / f"{routing}.gguf", progress=False, routing=routing, **SHAPE)
        out[routing] = routing_stats(record(convert(str(gguf), root / routing, progress=False), 100), E, [0.25])
    return out


def test_uniform_routing_is_uniform_and_independent(regimes):
    s = regimes["uniform"]
    assert s["entropy"] > 0.95 and s["top_quarter_share"] < 0.42
    assert abs(s["consecutive_reuse"] - K / E) < 0.05
    assert s["lru"]["0.25"]["steady"] < 0.35  # an LRU cache of a quarter of the experts: about a quarter


def test_own_routing_is_sticky_and_skewed_between(regimes):
    own, uniform, skewed = regimes["own"], regimes["uniform"], regimes["skewed"]
    assert own["consecutive_reuse"] > 2 * K / E and own["entropy"] < 0.85
    assert own["lru"]["0.25"]["steady"] > uniform["lru"]["0.25"]["steady"] + 0.25
    assert uniform["consecutive_reuse"] + 0.05 < skewed["consecutive_reuse"]
    assert skewed["entropy"] < uniform["entropy"] - 0.05
    assert uniform["lru"]["0.25"]["steady"] < skewed["lru"]["0.25"]["steady"]


def test_flash_directory_presets_take_the_routing(tmp_path):
    shape = {k: v for k, v in SHAPE.items() if k != "model_type"}
    path = build("moe-small", tmp_path / "uniform", progress=False, routing="uniform", **shape)
    assert regime_of(FlashDir(path)) == "uniform"
    s = routing_stats(record(path, 100), E)
    assert s["entropy"] > 0.95 and abs(s["consecutive_reuse"] - K / E) < 0.05
    with pytest.raises(ValueError, match="routing"):
        build("tiny", tmp_path / "dense", progress=False, routing="uniform")


def test_lru_and_cold_steady_hit_rates():
    trace = np.array([[[0, 1]], [[2, 3]], [[0, 1]], [[0, 2]], [[0, 2]]])  # [tokens, layers, k]
    r = lru_hit_rates(trace, 3)
    # 2 + 2 misses fill the 3 slots (cold: tokens 0-1); then 0 and 1 were evicted (2 misses), 0 hits and 2 misses
    # (evicting 3), 0 and 2 hit
    assert r["filled_at_token"] == 2 and r["cold"] == 0.0
    assert r["steady"] == pytest.approx((0 + 1 + 2) / 6) and r["hit_rate"] == pytest.approx(3 / 10)
    assert split_hit_rate([0, 5], [4, 0], 10) == {
        "hit_rate": 5 / 9,
        "cold": 5 / 9,
        "steady": None,
        "filled_at_token": None,
    }
