"""Decode speed of an MoE flash directory under memory budgets, with its routing checked.

    python benchmarks/moe_decode.py --model DIR --budgets 25%,50%,none --tokens 64 [--routing model,skewed] \
        [--read-ahead on,off] [--rounds N] [--json out.json]

Random-weight models repeat one token when they generate, so every step would route alike and every
expert read would hit. Here each step's input is instead a random token id (teacher-forced, the same
sequence for every budget: labelled "forced random tokens"), which gives routing as varied as random
weights allow. `--routing skewed` replays a recorded trace instead of the router's choice (labelled: the
tokens are then not the model's): per layer, experts drawn by Zipf popularity (s = --zipf) and each of the
previous token's experts kept with probability --burst, the reuse real routers show (published per-layer
LRU hit rates of real MoE models: 49-82%); the trace is written next to the JSON. Per budget and routing,
in a fresh process with the directory's page cache dropped: tokens/s over the decode steps (after a 1-token
prompt), hit rate of the expert caches overall, at cold start (until the misses first fill the caches) and in
steady state (after), device bytes and I/O wait per token, experts used per layer over the run, the routing
regime (a synthetic directory's --routing, tools/synthetic.py) and its measured consecutive-token reuse and
per-expert frequency (entropy), and what the missed bytes would take at fio's rate of the same run;
with `--read-ahead on,off`, the next layer's experts read ahead (read_ahead.IntoCache) against none: bytes
read ahead, of them unused, and how many of the routed experts the next layer's router predicted (a skewed
trace replaces the router's choice, so there the prediction has nothing to predict: labelled).
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from mlx_flash.format.directory import FlashDir
from mlx_flash.io.reader import DEFAULT_THREADS
from mlx_flash.peers import fio_reference
from mlx_flash.tools.bench_io import machine_info
from mlx_flash.tools.cap import drop_page_cache
from mlx_flash.tools.routing import regime_of

import numpy as np
from tqdm import tqdm

_CHILD = """
import json, statistics, sys, time
import numpy as np
import mlx_flash  # noqa: F401
import mlx.core as mx
from mlx_flash.loader import load
from mlx_flash.tools.routing import engine_hit_rates, routing_stats
model_dir, budget, n, trace, ahead = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5] == "on"
model, _ = load(model_dir, memory_budget=None if budget == "none" else budget, context=n + 16, prefetch=ahead)
e = model.flash
vocab = e.fd.config["vocab_size"]
ids = np.random.default_rng(0).integers(0, vocab, n + 1)
step = [0]
# step s, layer l reads replay[s, l] whatever the router chose
replay = np.load(trace)["experts"] if trace != "-" else None
layers = [i for i, c in enumerate(e.caches) if c]
k = e.fd.config.get("num_experts_per_tok") or e.fd.config.get("num_experts_per_token")
routed = np.zeros((n + 1, len(layers), k), dtype=np.int64)

def route(layer, chosen):
    chosen = replay[step[0], layer].astype(chosen.dtype) if replay is not None else chosen
    routed[step[0], layers.index(layer)] = chosen
    return chosen

e.route = route
cache = model.make_cache()
times = []
for i, t in enumerate(ids):
    step[0] = i
    tic = time.perf_counter()
    # the native decode step where the model has one, as generate runs it
    mx.eval(model.forward([int(t)], cache))
    times.append(time.perf_counter() - tic)
e.stats.end()
toks = e.stats.tokens[1:]
hits, misses = sum(t.hits for t in toks), sum(t.misses for t in toks)
per_layer = [int((c.use_count > 0).sum()) for layer in e.caches for c in layer.values()]  # every activation counts
split, regime = engine_hit_rates(e), routing_stats(routed, e.fd.ffn["n_experts"], slots=())
print(json.dumps({"tok_s": (len(times) - 1) / sum(times[1:]), "token_ms": 1e3 * statistics.median(times[1:]),
                  "token_ms_mean": 1e3 * statistics.mean(times[1:]), "hit_rate_cold": split["hit_rate_cold"],
                  "hit_rate_steady": split["hit_rate_steady"], "cache_filled_at": split["cache_filled_at"],
                  "consecutive_reuse": regime["consecutive_reuse"], "uniform_reuse": regime["uniform_reuse"],
                  "expert_entropy": regime["entropy"],
                  "hit_rate": hits / max(1, hits + misses),
                  "bytes_per_token": statistics.median(t.bytes_read for t in toks),
                  "missed_bytes_per_token": statistics.median(t.misses for t in toks) * e.layout.stride,
                  "io_ms": 1e3 * statistics.median(t.io_s for t in toks), "experts_used_per_layer": per_layer,
                  "slots": e.plan.capacity[0].get("experts"), "peak_rss": e.stats.peak_rss(),
                  "prediction_accuracy": e.stats.summary()["prediction_accuracy"],
                  "ahead_bytes_per_token": statistics.median(t.ahead_bytes for t in toks),
                  "ahead_wasted_bytes_per_token": statistics.median(t.ahead_wasted_bytes for t in toks)}))
"""


def skewed_trace(
    tokens: int, layers: int, experts: int, k: int, zipf: float, burst: float, seed: int = 0
) -> np.ndarray:
    """[tokens, layers, k] expert ids: each layer's own Zipf popularity over its experts, and each of the
    previous token's experts kept with probability `burst`."""
    rng = np.random.default_rng(seed)
    out = np.zeros((tokens, layers, k), dtype=np.int32)
    for layer in range(layers):
        p = 1.0 / np.arange(1, experts + 1) ** zipf
        p = (p / p.sum())[np.argsort(rng.permutation(experts))]  # which expert is popular differs per layer
        prev = rng.choice(experts, k, replace=False, p=p)
        for t in range(tokens):
            keep = prev[rng.random(k) < burst] if t else prev
            q = p.copy()
            q[keep] = 0
            new = rng.choice(experts, k - len(keep), replace=False, p=q / q.sum())
            out[t, layer] = prev = np.concatenate([keep, new])
    return out


def setup_arg_parser():
    p = argparse.ArgumentParser(description="MoE decode under memory budgets (forced random tokens).")
    p.add_argument("--model", required=True, help="MoE flash directory.")
    p.add_argument("--budgets", default="50%,none", help="Comma-separated budgets (none: every expert cached).")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument(
        "--routing",
        default="model",
        help="Comma-separated: model (the router's choice: the directory's regime), skewed (a replayed trace).",
    )
    p.add_argument("--zipf", type=float, default=1.0, help="skewed: Zipf exponent of each layer's expert popularity.")
    p.add_argument(
        "--burst", type=float, default=0.5, help="skewed: chance each of the previous token's experts is kept."
    )
    p.add_argument(
        "--read-ahead", default="on", help="Comma-separated: on (load's default: read_ahead.IntoCache), off."
    )
    p.add_argument("--json", default=None)
    return p


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    budgets, routings = args.budgets.split(","), args.routing.split(",")
    fd = FlashDir(args.model)
    trace = "-"
    if "skewed" in routings:
        info, c = fd.ffn, fd.config
        k = c.get("num_experts_per_tok") or c.get("num_experts_per_token")
        experts = skewed_trace(args.tokens + 1, len(fd.layers), info["n_experts"], k, args.zipf, args.burst)
        trace = str(Path(args.json or "moe_trace").with_suffix("")) + "_trace.npz"
        np.savez_compressed(trace, experts=experts, zipf=args.zipf, burst=args.burst)
    fio = fio_reference(fd.ffn_path, DEFAULT_THREADS)
    runs = []
    aheads = args.read_ahead.split(",")
    jobs = [(r, b, g, a) for r in range(args.rounds) for b in budgets for g in routings for a in aheads]
    for r, b, g, a in tqdm(jobs, desc="moe decode", unit="run"):
        drop_page_cache([args.model])
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, args.model, b, str(args.tokens), trace if g == "skewed" else "-", a],
            capture_output=True,
            text=True,
        )
        if out.returncode:
            raise SystemExit(f"budget {b}: {out.stderr[-2000:]}")
        runs.append(
            {"round": r, "budget": b, "routing": g, "read_ahead": a, **json.loads(out.stdout.strip().splitlines()[-1])}
        )
    rate = fio["bytes_per_s"] if fio else None
    regime = regime_of(fd)
    print(
        f"{args.model}: {args.tokens} forced random tokens (decode steps), medians over {args.rounds} round(s); "
        + (f"fio {rate / 2**30:.2f} GiB/s" if rate else "no fio")
    )
    print(
        "| routing | budget | read-ahead | expert slots/layer | tok/s | ms/token | hit rate (cold, steady) "
        "| consecutive reuse (uniform) | read/token (missed experts) "
        "| read ahead/token (unused) | next router predicted | I/O wait/token | missed / fio "
        "| experts used per layer (min-max) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for g in routings:
        for b in budgets:
            for a in aheads:
                rs = [x for x in runs if x["budget"] == b and x["routing"] == g and x["read_ahead"] == a]
                med = lambda key: statistics.median(x[key] for x in rs)  # noqa: E731
                used = rs[0]["experts_used_per_layer"]
                label = (
                    f"model's: {regime} (forced random tokens)"
                    if g == "model"
                    else f"skewed trace (zipf {args.zipf}, burst {args.burst})"
                )
                steady = [x["hit_rate_steady"] for x in rs if x["hit_rate_steady"] is not None]
                acc = rs[0]["prediction_accuracy"]
                print(
                    f"| {label} | {b} | {a} | {rs[0]['slots']} | {med('tok_s'):.2f} | {med('token_ms'):.0f} | "
                    f"{med('hit_rate'):.1%} ({med('hit_rate_cold'):.1%}, "
                    + (f"{statistics.median(steady):.1%}" if steady else "not filled")
                    + f") | {med('consecutive_reuse'):.1%} ({rs[0]['uniform_reuse']:.1%}) | "
                    f"{med('bytes_per_token') / 2**20:.1f} MiB "
                    f"({med('missed_bytes_per_token') / 2**20:.1f} MiB) | "
                    f"{med('ahead_bytes_per_token') / 2**20:.1f} MiB "
                    f"({med('ahead_wasted_bytes_per_token') / 2**20:.1f} MiB) | "
                    + ("-" if acc is None else f"{statistics.median(x['prediction_accuracy'] for x in rs):.1%}")
                    + f" | {med('io_ms'):.0f} ms | "
                    + (f"{1e3 * med('missed_bytes_per_token') / rate:.0f} ms" if rate else "-")
                    + f" | {min(used)}-{max(used)} |"
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "model": args.model,
                    "tokens": args.tokens,
                    "routing": regime_of(fd),
                    "fio": fio,
                    "trace": None if trace == "-" else trace,
                    "runs": runs,
                    "machine": machine_info(args.model),
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
