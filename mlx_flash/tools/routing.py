"""The routing regime of an MoE flash directory, measured.

    python -m mlx_flash.tools.routing --model DIR [--tokens 100] [--slots 0.25,0.5] [--json OUT]

Feeds random token ids one at a time (as llama-bench's generation test does), records each layer's chosen
experts and reports: per-expert frequency (the most used expert's share over the uniform 1/E, the share of the
most used quarter of the experts, normalised entropy), consecutive-token reuse (the share of a token's experts
the previous token also chose; independent uniform routing gives k/E) and the hit rate of an LRU cache of a given
share of each layer's experts, cold start (until the cache first fills) and steady state (after) apart.
"""

import argparse
import json
import sys
from collections import OrderedDict

import numpy as np

from ..format.directory import FlashDir
from ..loader import load


def record(model_dir, tokens: int = 100, seed: int = 0, memory_budget=None) -> np.ndarray:
    """[tokens, MoE layers, k] experts chosen for `tokens` random token ids fed one at a time."""
    import mlx.core as mx

    model, _ = load(model_dir, memory_budget=memory_budget, context=tokens + 16)
    engine = model.flash
    steps = []

    def route(layer, chosen):
        if layer == engine_layers[0]:
            steps.append({})
        steps[-1][layer] = chosen.copy()
        return chosen

    engine_layers = [i for i, c in enumerate(engine.caches) if c]
    engine.route = route
    try:
        cache = model.make_cache()
        ids = np.random.default_rng(seed).integers(0, engine.fd.config["vocab_size"], tokens)
        for t in ids:
            mx.eval(model(mx.array([[int(t)]]), cache=cache))
    finally:
        engine.route = None
        engine.close()
    return np.stack([np.stack([s[layer] for layer in engine_layers]) for s in steps])


def lru_hit_rates(trace: np.ndarray, slots: int) -> dict:
    """An LRU cache of `slots` experts per layer over `trace` [tokens, layers, k]: hit rate overall, before the
    caches first fill (cold) and after (steady; None if they never fill), and the token at which they filled."""
    tokens, layers, _ = trace.shape
    hits = np.zeros(tokens)
    misses = np.zeros(tokens)
    for layer in range(layers):
        cache = OrderedDict()
        for t in range(tokens):
            for e in map(int, trace[t, layer]):
                if e in cache:
                    hits[t] += 1
                    cache.move_to_end(e)
                else:
                    misses[t] += 1
                    cache[e] = None
                    if len(cache) > slots:
                        cache.popitem(last=False)
    return split_hit_rate(hits, misses, slots * layers)


def split_hit_rate(hits, misses, capacity: int) -> dict:
    """Hit rate of per-token `hits` and `misses` overall, cold (up to the token whose misses fill `capacity`
    units of cache, each miss filling one) and steady (after it; None if the cache never fills)."""
    hits, misses = np.asarray(hits, float), np.asarray(misses, float)
    filled = np.flatnonzero(np.cumsum(misses) >= capacity) if capacity > 0 else np.array([0])
    fill = int(filled[0]) + 1 if filled.size else len(hits)

    def rate(h, m):
        return float(h.sum() / (h.sum() + m.sum())) if h.sum() + m.sum() else None

    return {
        "hit_rate": rate(hits, misses),
        "cold": rate(hits[:fill], misses[:fill]),
        "steady": rate(hits[fill:], misses[fill:]),
        "filled_at_token": fill if filled.size else None,
    }


def engine_hit_rates(engine) -> dict:
    """A flash model's caches (`model.flash`) over its decode passes: hit rate overall, cold start (until the
    misses first fill every cache, the prompt's included) and steady state (after)."""
    caches = [c for layer in engine.caches for c in layer.values()]
    capacity = sum(c.capacity for c in caches)
    prompt = [t for t in engine.stats.tokens if t.prefill]
    toks = engine.stats.decode_tokens()
    r = split_hit_rate([t.hits for t in toks], [t.misses for t in toks], capacity - sum(t.misses for t in prompt))
    return {
        "hit_rate": r["hit_rate"],
        "hit_rate_cold": r["cold"],
        "hit_rate_steady": r["steady"],
        "cache_filled_at": r["filled_at_token"],
        "cache_units": capacity,
    }


def routing_stats(trace: np.ndarray, n_experts: int, slots=(0.25, 0.5)) -> dict:
    """Per-expert frequency, consecutive-token reuse and LRU hit rates (`slots`: shares of a layer's experts)
    of `trace` [tokens, layers, k]."""
    tokens, layers, k = trace.shape
    counts = np.stack([np.bincount(trace[:, layer].ravel(), minlength=n_experts) for layer in range(layers)])
    share = counts / counts.sum(axis=1, keepdims=True)
    top = np.sort(share, axis=1)[:, ::-1]
    entropy = -np.sum(np.where(share > 0, share * np.log(np.maximum(share, 1e-30)), 0), axis=1) / np.log(n_experts)
    reuse = [
        len(np.intersect1d(trace[t, layer], trace[t - 1, layer])) / k
        for t in range(1, tokens)
        for layer in range(layers)
    ]
    return {
        "tokens": tokens,
        "layers": layers,
        "experts": n_experts,
        "k": k,
        "max_share_over_uniform": float(np.mean(top[:, 0] * n_experts)),
        "top_quarter_share": float(np.mean(top[:, : max(1, n_experts // 4)].sum(axis=1))),
        "entropy": float(np.mean(entropy)),
        "consecutive_reuse": float(np.mean(reuse)) if reuse else None,
        "uniform_reuse": k / n_experts,
        "lru": {
            f"{s:g}": dict(lru_hit_rates(trace, max(1, round(s * n_experts))), slots=max(1, round(s * n_experts)))
            for s in slots
        },
    }


def regime_of(fd) -> str:
    """The routing regime a synthetic flash directory was built with, or "measured" when not recorded."""
    return (fd.manifest.get("source") or {}).get("routing") or "measured"


def describe(stats: dict) -> str:
    lru = "; ".join(
        f"LRU {v['slots']}/{stats['experts']} slots: hit {v['hit_rate']:.1%} (cold {v['cold']:.1%}, steady "
        + (f"{v['steady']:.1%})" if v["steady"] is not None else "-)")
        for v in stats["lru"].values()
    )
    return (
        f"{stats['tokens']} random tokens, {stats['layers']} MoE layers, top-{stats['k']} of {stats['experts']}: "
        f"consecutive reuse {stats['consecutive_reuse']:.1%} (uniform {stats['uniform_reuse']:.1%}), most used "
        f"expert {stats['max_share_over_uniform']:.2f}x uniform, top quarter {stats['top_quarter_share']:.1%} of "
        f"choices, entropy {stats['entropy']:.3f}; {lru}"
    )


def main(argv=None):
    p = argparse.ArgumentParser(description="Measure an MoE flash directory's routing regime on random tokens.")
    p.add_argument("--model", required=True, help="MoE flash directory.")
    p.add_argument("--tokens", type=int, default=100)
    p.add_argument("--slots", default="0.25,0.5", help="LRU cache sizes, shares of a layer's experts.")
    p.add_argument("--memory-budget", default=None, help="load's budget (routing does not depend on it).")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    fd = FlashDir(a.model)
    stats = routing_stats(
        record(a.model, a.tokens, memory_budget=a.memory_budget),
        fd.ffn["n_experts"],
        [float(s) for s in a.slots.split(",")],
    )
    stats["regime"] = regime_of(fd)
    print(f"{a.model} ({stats['regime']} routing): {describe(stats)}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(stats, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
