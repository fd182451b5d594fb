"""Two checkouts of mlx_flash (e.g. before and after a change) timed alike, alternated over rounds.

    python benchmarks/ab_checkouts.py --before DIR --after DIR [--model FLASH_DIR] [--budgets 80%,50%]
        [--rounds 3] [--tokens 40] [--cap 2.5GiB] [--sparsity dense] [--json benchmarks/results/ab_checkouts.json]

Each run is `python -m mlx_flash.generate --stats --sparsity dense --temp 0` started in the checkout's
directory (so it imports that checkout's package and its built kernels: `python setup.py build_ext --inplace`
there first), with this interpreter. Recorded per run: the summary's median token time and its compute and
I/O parts, and the generated text (whether each checkout prints one text at every budget, and whether the two
print the same). --cap runs each under that hard memory cap (`mlx_flash.tools.cap`, the model's files dropped from
the page cache first).
"""

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

PROMPT = "Once upon a time there was a"
SUMMARY = re.compile(
    r"summary over \d+ tokens \(medians\): io +([\d.]+) ms, mm +([\d.]+) ms, compute +([\d.]+) ms, "
    r"total +([\d.]+) ms"
)


def run(checkout: Path, model, budget: str, tokens: int, cap=None, sparsity="dense") -> dict:
    cmd = [
        sys.executable,
        "-m",
        "mlx_flash.generate",
        "--prompt",
        PROMPT,
        "--ignore-chat-template",
        "--memory-budget",
        budget,
        "--max-tokens",
        str(tokens),
        "--temp",
        "0",
        "--sparsity",
        sparsity,
        "--stats",
    ]
    cmd += ["--model", str(model)] if model else []
    if cap:  # (the checkout's own cap: both have mlx_flash.tools.cap)
        cmd = [
            sys.executable,
            "-m",
            "mlx_flash.tools.cap",
            "--limit",
            cap,
            *(["--drop", str(model)] if model else []),
            "--",
            *cmd,
        ]
    out = subprocess.run(cmd, cwd=checkout, capture_output=True, text=True, check=True).stdout
    io, mm, compute, total = map(float, SUMMARY.search(out).groups())
    return {
        "total_ms": total,
        "compute_ms": compute,
        "io_ms": io,
        "mm_ms": mm,
        "text": re.split(r"\n(?:\[token|Prompt:|summary)", out)[0],
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", required=True, type=Path)
    p.add_argument("--after", required=True, type=Path)
    p.add_argument("--model", default=None, help="Flash directory (default: the default model).")
    p.add_argument("--budgets", default="80%,50%")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=40)
    p.add_argument("--cap", default=None, help="Hard memory cap for every run (e.g. 2.5GiB).")
    p.add_argument("--sparsity", default="dense")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    runs = {b: {"before": [], "after": []} for b in args.budgets.split(",")}
    for r in range(args.rounds):
        for budget, sides in runs.items():
            for side in ("before", "after"):
                res = run(getattr(args, side), args.model, budget, args.tokens, args.cap, args.sparsity)
                sides[side].append(res)
                print(
                    f"round {r + 1} {budget} {side}: total {res['total_ms']:.2f} ms, "
                    f"compute {res['compute_ms']:.2f} ms",
                    flush=True,
                )
    summary = {}
    for budget, sides in runs.items():
        med = {
            s: {k: statistics.median(x[k] for x in v) for k in ("total_ms", "compute_ms", "io_ms")}
            for s, v in sides.items()
        }
        summary[budget] = {**med, "after/before total": med["after"]["total_ms"] / med["before"]["total_ms"]}
        print(budget, json.dumps(summary[budget]))
    for side in ("before", "after"):  # the same text at every budget?
        summary[f"{side}: one text at every budget"] = len({x["text"] for s in runs.values() for x in s[side]}) == 1
    for budget, sides in runs.items():  # the same text from both checkouts?
        summary[f"{budget}: same text before and after"] = {x["text"] for x in sides["before"]} == {
            x["text"] for x in sides["after"]
        }
    print({k: v for k, v in summary.items() if "text" in k})
    if args.json:
        Path(args.json).write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary, "runs": runs}, indent=1)
            + "\n"
        )


if __name__ == "__main__":
    main()
