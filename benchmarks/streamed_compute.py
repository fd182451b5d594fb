"""A decode token's compute from streamed FFN rows against resident rows (issue #24).

    python benchmarks/streamed_compute.py --model DIR --memory-budget 2300MiB --rounds 3 [--json out.json]

Three runs per round, alternated, each in a fresh process with the directory's page cache dropped:
resident (no budget), streamed with reads overlapped with compute (the default), and streamed serially
(each chunk read, then computed; no read-ahead), so the compute of the streamed rows is timed with and
without the readers running beside it. Figures are `generate --stats`' medians per token.
"""

import argparse
import json
import statistics
import subprocess
import sys

from mlx_flash.tools.bench_io import machine_info
from mlx_flash.tools.cap import drop_page_cache

from tqdm import tqdm

MODES = ("resident", "overlapped", "serial")

_CHILD = """
import json, sys
import mlx_flash  # noqa: F401
import mlx.core as mx
from mlx_flash.generate import generate_step
from mlx_flash.loader import load
model_dir, budget, mode, n, prompt = sys.argv[1:6]
model, tok = load(model_dir, memory_budget=None if mode == "resident" else budget, sparsity="dense", context=256)
e = model.flash
if mode == "serial":
    e.overlap, e.read_ahead = False, None
for _ in generate_step(mx.array(tok.encode(prompt)), model, max_tokens=int(n)):
    pass
print(json.dumps(e.stats.summary()))
"""


def setup_arg_parser():
    p = argparse.ArgumentParser(description="Compute per token from streamed rows vs resident rows.")
    p.add_argument("--model", required=True, help="Flash directory.")
    p.add_argument("--memory-budget", default="2300MiB", help="Budget of the streamed runs.")
    p.add_argument("--prompt", default="Once upon a time")
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None, help="Write the runs here.")
    return p


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    runs = []
    jobs = [(r, MODES[(i + r) % 3]) for r in range(args.rounds) for i in range(3)]
    for r, mode in tqdm(jobs, desc="streamed compute", unit="run"):
        drop_page_cache([args.model])
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, args.model, args.memory_budget, mode, str(args.max_tokens), args.prompt],
            capture_output=True,
            text=True,
            check=True,
        )
        s = json.loads(out.stdout.strip().splitlines()[-1])
        runs.append({"round": r, "mode": mode, **s})
    print(
        f"{args.model}, {args.max_tokens} tokens, budget {args.memory_budget}; "
        "ms per token (medians of tokens), by round"
    )
    print("| run | compute | waiting for reads | total | hit rate |\n|---|---|---|---|---|")
    med = {}
    for mode in MODES:
        rs = [x for x in runs if x["mode"] == mode]
        col = lambda k: ", ".join(f"{x[k]:.0f}" for x in rs)  # noqa: E731
        med[mode] = statistics.median(x["compute_ms"] for x in rs)
        print(f"| {mode} | {col('compute_ms')} | {col('io_ms')} | {col('total_ms')} | {rs[0]['hit_rate']:.2f} |")
    for mode in MODES[1:]:
        print(f"{mode} compute / resident compute (medians): {med[mode] / med['resident']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "model": args.model,
                    "budget": args.memory_budget,
                    "tokens": args.max_tokens,
                    "runs": runs,
                    "machine": machine_info(args.model),
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
