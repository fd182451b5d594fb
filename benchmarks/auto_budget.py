"""A model bigger than memory with no budget flag: `python -m mlx_flash.generate` (its default `--memory-budget auto`)
under hard memory caps, against the same command with no cap (where the model fits: every unit resident).

    python benchmarks/auto_budget.py --model DIR --caps 2.5GiB,1.5GiB [--backends auto,mlx] [--max-tokens 8] \
        --json benchmarks/results/auto_budget_llama7b.json

Each run: the page cache of the model dropped, a child memory cgroup of the cap (tools/cap), greedy decoding of a
fixed prompt. Reported: exit code, OOM kill, the generated text and whether it equals the uncapped run's, what auto
found and chose (the --stats line), peak RSS above the baseline, decode tokens/s.
"""

import argparse
import json
import re
import sys
from pathlib import Path

import mlx_flash  # noqa: F401  (OpenBLAS before mlx.core)
from mlx_flash.budget import parse_size
from mlx_flash.format.directory import FlashDir
from mlx_flash.tools.bench_io import machine_info, run_fio
from mlx_flash.tools.cap import run_capped
from mlx_flash.tools.peers_systems import versions

PROMPT = "The lighthouse keeper found a message in a bottle and read it by the lamp."


def text_of(stdout: str) -> str:
    """The generated text: what mlx-lm's verbose output prints before its statistics."""
    text, sep, _ = stdout.partition("\n==========\nPrompt:")
    return text if sep else None


def run(model: str, cap, backend: str, max_tokens: int) -> dict:
    cmd = [sys.executable, "-m", "mlx_flash.generate", "--model", model, "--prompt", PROMPT, "--backend", backend]
    cmd += ["-m", str(max_tokens), "--temp", "0", "--ignore-chat-template", "--stats"]
    r = run_capped(cmd, limit=cap, drop=[model], timeout=3600)
    auto = re.search(r"^memory: auto: .*$", r.stdout, re.M)
    peak = re.search(r"memory: peak RSS (.*?) above", r.stdout)
    speed = re.search(r"Generation: \d+ tokens, ([\d.]+) tokens-per-sec", r.stdout)
    return {
        "cap": cap,
        "backend": backend,
        "returncode": r.returncode,
        "oom_killed": r.oom_killed,
        "text": text_of(r.stdout),
        "auto": auto.group(0) if auto else None,
        "peak_rss_above_baseline": peak.group(1) if peak else None,
        "cgroup_peak": r.cgroup_peak,
        "decode_tokens_per_s": float(speed.group(1)) if speed else None,
        "stderr_tail": r.stderr[-400:] if r.returncode else "",
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--caps", default="2.5GiB,1.5GiB")
    p.add_argument("--backends", default="auto,mlx")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    ffn = FlashDir(args.model).ffn_path
    out = {
        "command": " ".join(["python", *sys.argv]),
        "model": args.model,
        "machine": machine_info(args.model),
        "fio_randread_1MiB_GiB_s": run_fio(str(ffn), ffn.stat().st_size, 1 << 20, 16, 5)[0],
        "versions": versions(),
        "rows": [],
    }

    def add(row):  # (written after each run: a long run's rows survive its end)
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(out, indent=1))

    for backend in args.backends.split(","):
        free = run(args.model, None, backend, args.max_tokens)
        add(free)
        for cap in args.caps.split(","):
            row = run(args.model, parse_size(cap), backend, args.max_tokens)
            row["cap"] = cap
            row["same_text_as_uncapped"] = row["text"] is not None and row["text"] == free["text"]
            add(row)


if __name__ == "__main__":
    main()
