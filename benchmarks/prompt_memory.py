"""Peak memory against the budget as the prompt grows: `python -m mlx_flash.generate --stats` on raw prompts of
increasing length, uncapped (the peak RSS above the baseline it prints) and under a hard cap of budget + baseline
(OOM-killed or not; `--capped-only`: that run alone), or with `--memory-budget auto` under a given cap only. A
prompt whose context the budget cannot hold is refused before any work, with the longest context it holds.

    python benchmarks/prompt_memory.py --model DIR --memory-budget 2300MiB --lengths 16,64,300,1024,4096,8192 \
        --json benchmarks/results/prompt_memory_llama7b.json
    python benchmarks/prompt_memory.py --model DIR --memory-budget auto --cap 2.5GiB ...
"""

import argparse
import json
import re
import sys
from pathlib import Path

import mlx_flash  # noqa: F401  (OpenBLAS before mlx.core)
from mlx_flash.budget import is_auto, parse_size
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
    p.add_argument("--memory-budget", required=True, help="A budget, or auto (then give --cap).")
    p.add_argument("--cap", default=None, help="The hard cap (default: the budget + the baseline).")
    p.add_argument("--lengths", default="16,64,150,300")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--kv-bits", type=int, default=None, help="generate's --kv-bits (a quantised KV cache).")
    p.add_argument("--capped-only", action="store_true", help="Skip the uncapped run (the capped run's peak is shown).")
    args = p.parse_args()
    fd = FlashDir(args.model)
    tokenizer = load_tokenizer(fd)
    baseline = run_capped(memory.baseline_command(args.model)).max_rss
    budget = None if is_auto(args.memory_budget) else parse_size(args.memory_budget, fd.model_bytes)
    cap = parse_size(args.cap) if args.cap else budget + baseline
    out = {"command": " ".join(["python", *sys.argv]), "machine": machine_info(args.model), "versions": versions()}
    out.update(model=args.model, budget=args.memory_budget, cap=cap, baseline=baseline, rows=[])
    for n in map(int, args.lengths.split(",")):
        cmd = [sys.executable, "-m", "mlx_flash.generate", "--model", args.model, "--memory-budget"]
        cmd += [args.memory_budget, "-m", "4", "--temp", "0", "--ignore-chat-template", "--stats"]
        cmd += ["--prompt", prompt_of(tokenizer, n)] + (["--kv-bits", str(args.kv_bits)] if args.kv_bits else [])
        uncapped = budget is not None and not args.capped_only
        free = run_capped(cmd, drop=[args.model], timeout=3600) if uncapped else None
        capped = run_capped(cmd, limit=cap, drop=[args.model], timeout=3600)
        shown = capped if free is None else free
        m = re.search(r"Prompt: (\d+) tokens, ([\d.]+) tokens-per-sec", shown.stdout)
        peak = re.search(r"memory: peak RSS ([\d.]+) (KiB|MiB|GiB) above", shown.stdout)
        refused = re.search(r"it holds a context of at most (\d+) tokens", capped.stderr)
        out["rows"].append(
            {
                "prompt_tokens": int(m.group(1)) if m else n,
                "prompt_tokens_per_s": float(m.group(2)) if m else None,
                "peak_above_baseline": float(peak.group(1)) * UNITS[peak.group(2)] if peak else None,
                "capped_oom_killed": capped.oom_killed,
                "capped_returncode": capped.returncode,
                "refused_longest_context": int(refused.group(1)) if refused else None,
                "stderr_tail": capped.stderr[-300:] if capped.returncode else "",
            }
        )
        r = out["rows"][-1]
        print(json.dumps(r), flush=True)
        if args.json:
            args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
