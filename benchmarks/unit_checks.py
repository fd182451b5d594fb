"""What checking each unit's checksum costs: `python -m mlx_flash.generate` under a hard cap with the checks on and
off (MLX_FLASH_CHECK_UNITS=0), alternating, the page cache of the model dropped before each run.

    python benchmarks/unit_checks.py --model DIR --memory-budget 50% [--model DIR2 --memory-budget 2300MiB] \
        --rounds 3 --max-tokens 32 --json benchmarks/results/unit_checks.json

A unit is checked the first time the process reads it (io/checks.py), so the cost falls on the prompt and the
first tokens: reported are the prompt's time, the mean of every decode token (the first included) and the median
(steady state), each the median over rounds.
"""

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

import mlx_flash  # noqa: F401  (OpenBLAS before mlx.core)
from mlx_flash.budget import parse_size
from mlx_flash.format.directory import FlashDir
from mlx_flash.io import memory
from mlx_flash.io.reader import DEFAULT_THREADS
from mlx_flash.peers import fio_reference
from mlx_flash.tools.bench_io import machine_info
from mlx_flash.tools.cap import run_capped
from mlx_flash.tools.peers_systems import versions

PROMPT = "Tell me a story."  # short: the 7B at 2300 MiB overshoots its cap on longer prompts (BENCHMARKS.md)
TOKEN = re.compile(
    r"\[token +\d+\] io +([\d.]+) ms \| mm +([\d.]+) ms \| (?:expand +([\d.]+) ms \| )?compute +([\d.]+)"
)


def run(model: str, budget: str, tokens: int, checks: bool, baseline: int) -> dict:
    limit = parse_size(budget, FlashDir(model).model_bytes) + baseline
    cmd = [sys.executable, "-m", "mlx_flash.generate", "--model", model, "--memory-budget", budget, "--stats"]
    cmd += ["-m", str(tokens), "--temp", "0", "--prompt", PROMPT]
    r = run_capped(cmd, limit=limit, drop=[model], timeout=1800, env={"MLX_FLASH_CHECK_UNITS": "1" if checks else "0"})
    if not r.ok:
        raise SystemExit(f"generate failed ({r.returncode}, oom {r.oom_killed}): {r.stderr[-2000:]}")
    prompt = re.search(r"Prompt: (\d+) tokens, ([\d.]+) tokens-per-sec", r.stdout)
    per_token = [sum(float(x or 0) for x in m.groups()) for m in TOKEN.finditer(r.stdout)]
    return {
        "prompt_tokens": int(prompt.group(1)),
        "prompt_s": int(prompt.group(1)) / float(prompt.group(2)),
        "first_token_ms": per_token[0],
        "mean_token_ms": statistics.mean(per_token),
        "median_token_ms": statistics.median(per_token),
        "tokens": len(per_token),
        "wall_s": r.wall_s,
        "max_rss": r.max_rss,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", required=True)
    p.add_argument("--memory-budget", action="append", required=True, help="One per --model.")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    results = {}
    for model, budget in zip(args.model, args.memory_budget):
        base = run_capped(memory.baseline_command(model))
        rounds = {"on": [], "off": []}
        for i in range(args.rounds):
            for side in ("on", "off") if i % 2 == 0 else ("off", "on"):
                rounds[side].append(run(model, budget, args.max_tokens, side == "on", base.max_rss))
                print(f"{Path(model).name} {budget} round {i + 1} checks {side}: {rounds[side][-1]}", file=sys.stderr)
        med = {s: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for s, rs in rounds.items()}
        results[f"{Path(model).name} at {budget}"] = {"rounds": rounds, "median": med}
        print(
            f"| {Path(model).name} at {budget} | "
            + " | ".join(
                f"{k}: on {med['on'][k]:.3f}, off {med['off'][k]:.3f} ({med['on'][k] / med['off'][k]:.3f}x)"
                for k in ("prompt_s", "first_token_ms", "mean_token_ms", "median_token_ms")
            )
            + " |"
        )
    if args.json:
        fio = {m: fio_reference(Path(m) / "ffn.bin", DEFAULT_THREADS) for m in args.model}  # the disk, same run
        info = {"machine": machine_info(args.model[0]), "versions": versions(), "fio": fio, "results": results}
        args.json.write_text(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
