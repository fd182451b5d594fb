"""An MoE decode token with the native decoder (decode.HostDecoder: attention in C, router in MLX ops, experts
from the engine) against MLX's forward (`--backend mlx`) with the same engine, alternated (issue #23).

    python benchmarks/native_moe_decode.py --model ~/.cache/mlx_flash/peers/qwen3-30b-a3b/flash --memory-budget 25% \
        --rounds 4 --tokens 20 [--json out.json]

Each round loads the model afresh (backend "native" or "mlx") and samples near-uniform tokens (temperature
10000, seed = the round: the same tokens both ways), as peers does for random-weight MoE models. The figure is
`--stats`' median ms a token; beside it the expert caches' hit rate, cold start (until they first fill) and
steady state apart, and the directory's routing regime (tools/synthetic.py's --routing, "measured" when not recorded).
"""

import argparse
import json
import statistics

import mlx_flash  # noqa: F401  (before mlx.core)
from mlx_flash.generate import generate_step
from mlx_flash.loader import load
from mlx_flash.tools.bench_io import machine_info
from mlx_flash.tools.routing import engine_hit_rates, regime_of

import mlx.core as mx
from mlx_lm.sample_utils import make_sampler


def setup_arg_parser():
    p = argparse.ArgumentParser(description="MoE decode: native decoder vs mlx-lm's forward, same engine.")
    p.add_argument("--model", required=True)
    p.add_argument("--memory-budget", default="25%")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--tokens", type=int, default=20)
    p.add_argument("--json", default=None)
    return p


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    res = {"native": [], "mlx-lm forward": []}
    hits = {k: [] for k in res}
    for r in range(args.rounds):
        for name in list(res) if r % 2 == 0 else list(res)[::-1]:
            backend = "native" if name == "native" else "mlx"
            model, tok = load(args.model, memory_budget=args.memory_budget, context=args.tokens + 32, backend=backend)
            if name == "native" and not model.forward.native:
                raise SystemExit(f"no native decode step for this model: {model.forward.why}")
            mx.random.seed(r)
            prompt = mx.array(tok.encode("Once upon a time"))
            for _ in generate_step(prompt, model, max_tokens=args.tokens, sampler=make_sampler(10000.0)):
                pass
            model.flash.stats.end()
            res[name].append(model.flash.stats.summary()["total_ms"])
            hits[name].append(engine_hit_rates(model.flash))
            model.flash.close()
    regime = regime_of(model.flash.fd)
    med = {k: statistics.median(v) for k, v in res.items()}
    print(
        f"{args.model} ({regime} routing) at {args.memory_budget}, {args.tokens} tokens, {args.rounds} rounds: ms a "
        f"token (medians of tokens) by round, hit rate (cold start, steady state)"
    )
    for k, v in res.items():
        rate = ", ".join(
            f"{h['hit_rate']:.1%} ({h['hit_rate_cold']:.1%}, "
            + (f"{h['hit_rate_steady']:.1%})" if h["hit_rate_steady"] is not None else "not filled)")
            for h in hits[k]
        )
        print(f"  {k}: {', '.join(f'{x:.0f}' for x in v)} (median {med[k]:.0f}); hit rate {rate}")
    print(f"native / mlx-lm forward: {med['native'] / med['mlx-lm forward']:.2f}x the time")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "model": args.model,
                    "routing": regime,
                    "budget": args.memory_budget,
                    "tokens": args.tokens,
                    "runs": res,
                    "hit_rates": hits,
                    "machine": machine_info(args.model),
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
