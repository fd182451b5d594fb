"""What a verification pass costs against its width (issue #25), under a hard memory cap.

    python benchmarks/spec_passes.py --model DIR --memory-budget 50% --widths 1,2,4,8,9,16,32 --rounds 3 \
        [--json out.json] [--plot out.png]

Each round is a fresh process under a cgroup limit of the budget + the interpreter's baseline (page cache of
the directory dropped first): the model loads at the budget (dense; an MoE model's experts by its router), runs
a short prompt and two warm-up
steps (the caches full), then times `--reps` passes of every width, in an order that rotates by round; after
each pass the KV cache is trimmed back, so every pass sees the same context. Per pass: wall time, device bytes
(the readers' counters), time waiting for reads. The plot gives the speed-up these costs predict for mean
accepted lengths 1-8 (tokens a pass yields, the bonus token included): L * t(1) / t(k + 1).
"""

import argparse
import json
import statistics
import sys

from mlx_flash.budget import parse_size
from mlx_flash.format.directory import FlashDir
from mlx_flash.io import memory
from mlx_flash.peers import fio_reference
from mlx_flash.tools.bench_io import machine_info
from mlx_flash.tools.cap import run_capped

from tqdm import tqdm

_CHILD = """
import json, sys
import mlx_flash  # noqa: F401
import mlx.core as mx
from mlx_lm.models.cache import trim_prompt_cache
from mlx_flash.loader import load
model_dir, budget, widths, reps = (
    sys.argv[1], int(sys.argv[2]), [int(w) for w in sys.argv[3].split(",")], int(sys.argv[4])
)
model, tok = load(model_dir, memory_budget=budget, sparsity="dense", context=256)
e, cache = model.flash, model.make_cache()
decoder = getattr(model, "decoder", None)


def run(tokens, prompt=False):
    if decoder is not None:  # the native passes (llama)
        return decoder(tokens, cache, prompt=prompt)
    out = model(mx.array([tokens]), cache=cache)  # mlx-lm's forward (MoE: the union of the positions' experts)
    mx.eval(out)
    return out


run(tok.encode("Once upon a time, in a land far away"), prompt=True)
for _ in range(2):
    run([100])
out = []
for w in widths:
    for _ in range(reps):
        e.stats.end()
        run(list(range(200, 200 + w)))
        e.stats.end()
        t = e.stats.tokens[-1]
        out.append(dict(width=w, total_ms=t.total_s * 1e3, io_ms=t.io_s * 1e3, bytes=t.bytes_read))
        trim_prompt_cache(cache, w)
print(json.dumps(dict(passes=out, peak_rss=e.stats.peak_rss())))
"""


def setup_arg_parser():
    p = argparse.ArgumentParser(description="Verification pass cost against width, under a hard memory cap.")
    p.add_argument("--model", required=True, help="Flash directory.")
    p.add_argument("--memory-budget", default="50%", help="The model's budget; the cap is this + the baseline.")
    p.add_argument("--widths", default="1,2,4,8,9,16,32", help="Positions per pass (k + 1).")
    p.add_argument("--reps", type=int, default=2, help="Passes of each width per round.")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, help="The predicted speed-up against mean accepted length (PNG).")
    return p


def speedup(cost: dict, width: int, length: float) -> float:
    """Tokens per second relative to plain decoding when a pass of `width` yields `length` tokens."""
    return length * cost[1] / cost[width]


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    widths = [int(w) for w in args.widths.split(",")]
    fd = FlashDir(args.model)
    budget = parse_size(args.memory_budget, fd.model_bytes)
    base = run_capped(memory.baseline_command(args.model))
    fio = fio_reference(fd.ffn_path, 8)
    runs = []
    for r in tqdm(range(args.rounds), desc="rounds", unit="round"):
        order = widths[r % len(widths) :] + widths[: r % len(widths)]
        res = run_capped(
            [sys.executable, "-c", _CHILD, args.model, str(budget), ",".join(map(str, order)), str(args.reps)],
            limit=budget + base.max_rss,
            drop=[args.model],
            timeout=3600,
        )
        if not res.ok:
            sys.exit(f"round {r} failed: {res.summary()}\n{res.stderr[-2000:]}")
        out = json.loads(res.stdout.strip().splitlines()[-1])
        runs.append(dict(round=r, cgroup_peak=res.cgroup_peak, **out))
    cost, rows = {}, []
    for w in widths:
        ps = [p for run in runs for p in run["passes"] if p["width"] == w]
        cost[w] = statistics.median(p["total_ms"] for p in ps)
        rows.append((w, cost[w], statistics.median(p["io_ms"] for p in ps), statistics.median(p["bytes"] for p in ps)))
    b1 = rows[0][3] if widths[0] == 1 else None
    print(
        f"{args.model}: budget {args.memory_budget} ({budget / 2**30:.2f} GiB), "
        f"cap {(budget + base.max_rss) / 2**30:.2f} GiB; "
        f"fio {fio['bytes_per_s'] / 2**30 if fio else float('nan'):.2f} GiB/s; "
        f"medians over {args.rounds} rounds x {args.reps}"
    )
    print("| positions (k+1) | ms a pass | x one position | waiting for reads, ms | device bytes | x one position |")
    print("|---|---|---|---|---|---|")
    for w, t, io, b in rows:
        print(
            f"| {w} | {t:.0f} | {t / cost.get(1, t):.2f} | {io:.0f} | {b / 2**30:.3f} GiB | "
            f"{b / b1 if b1 else float('nan'):.3f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "model": args.model,
                    "budget": budget,
                    "cap": budget + base.max_rss,
                    "fio": fio,
                    "runs": runs,
                    "cost_ms": cost,
                    "machine": machine_info(args.model),
                },
                f,
                indent=1,
            )
    if args.plot and 1 in cost:
        from mlx_flash.tools.plot import pyplot

        plt = pyplot()
        fig, ax = plt.subplots(figsize=(6, 4))
        for w in widths[1:]:
            lengths = [x / 4 for x in range(4, 4 * min(8, w) + 1)]
            ax.plot(lengths, [speedup(cost, w, x) for x in lengths], label=f"k+1 = {w}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xlabel("mean accepted length (tokens a pass yields)")
        ax.set_ylabel("expected speed-up over plain decoding")
        ax.set_title("Speculative decoding from measured pass costs")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
