"""Peak memory against the budget as the prompt grows: `python -m mlx_flash.generate --stats` on raw prompts of
increasing length, uncapped (the peak RSS above the baseline it prints) and under a hard cap of budget + baseline
(OOM-killed or not).

    python benchmarks/prompt_memory.py --model DIR --memory-budget 2300MiB --lengths 16,64,150,300 \
        --json benchmarks/results/prompt_memory_llama7b.json
"""

import argparse
import json
import re
import sys
from pathlib import Path

import mlx_flash  # noqa: F401  (OpenBLAS before mlx.core)
from mlx_flash.budget import parse_size
from mlx_flash.format.directory import FlashDir
from mlx_flash.io import memory
from mlx_flash.loader import load_tokenizer
from mlx_flash.tools.bench_io import machine_info
from mlx_flash.tools.cap import run_capped
from mlx_flash.tools.peers_systems import versions

SENTENCE = "The lighthouse keeper found a message in a bottle and read it by the lamp. "
UNITS = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def prompt_of(tokenizer, n: int) -> str:
    text = SENTENCE * (n // 8 + 1)
    return tokenizer.decode(tokenizer.encode(text)[1 : n + 1])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--memory-budget", required=True)
    p.add_argument("--lengths", default="16,64,150,300")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    fd = FlashDir(args.model)
    tokenizer = load_tokenizer(fd)
    budget = parse_size(args.memory_budget, fd.model_bytes)
    baseline = run_capped(memory.baseline_command(args.model)).max_rss
    rows = []
    for n in map(int, args.lengths.split(",")):
        cmd = [sys.executable, "-m", "mlx_flash.generate", "--model", args.model, "--memory-budget"]
        cmd += [args.memory_budget, "-m", "4", "--temp", "0", "--ignore-chat-template", "--stats"]
        cmd += ["--prompt", prompt_of(tokenizer, n)]
        free = run_capped(cmd, drop=[args.model], timeout=1800)
        m = re.search(r"Prompt: (\d+) tokens", free.stdout)
        peak = re.search(r"memory: peak RSS ([\d.]+) (KiB|MiB|GiB) above", free.stdout)
        capped = run_capped(cmd, limit=budget + baseline, drop=[args.model], timeout=1800)
        rows.append(
            {
                "prompt_tokens": int(m.group(1)) if m else None,
                "peak_above_baseline": float(peak.group(1)) * UNITS[peak.group(2)] if peak else None,
                "budget": budget,
                "capped_oom_killed": capped.oom_killed,
                "capped_returncode": capped.returncode,
            }
        )
        r = rows[-1]
        print(
            f"prompt {r['prompt_tokens']} tokens: peak RSS above the baseline "
            f"{r['peak_above_baseline'] / 2**20:.0f} MiB (budget {budget / 2**20:.0f} MiB); "
            "under a cap of budget + baseline: " + ("OOM-killed" if capped.oom_killed else f"exit {capped.returncode}")
        )
    if args.json:
        info = {"machine": machine_info(args.model), "versions": versions(), "model": args.model, "rows": rows}
        args.json.write_text(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
