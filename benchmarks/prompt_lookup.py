"""Speculative decoding against plain decoding on tasks that reuse their input (issue #25).

    python benchmarks/prompt_lookup.py [--model DIR] --memory-budget 50% --rounds 3 --max-tokens 160 \
        [--draft-model DIR] [--cap] [--json out.json]

Each task gives the model a text of its own (a WikiText-2 test passage, from the package's copy) and asks it
to summarise, extract or edit it. Per round and task, plain decoding, `--prompt-lookup` and (with
--draft-model) `--draft-model DIR` run in an order that alternates by round, each in a fresh
`python -m mlx_flash.generate` process (the user's command, greedy) with the page cache of the directory
dropped first, under a hard memory cap of the budget + the interpreter's baseline with --cap; the figures are
generate's own generation tokens/s and its speculative stats. The outputs are compared: greedy speculative
decoding must give the plain tokens.
"""

import argparse
import json
import re
import statistics
import subprocess
import sys

from mlx_flash.budget import parse_size
from mlx_flash.default_model import default_model_dir
from mlx_flash.format.directory import FlashDir
from mlx_flash.io import memory
from mlx_flash.texts import wikitext
from mlx_flash.tools.bench_io import machine_info
from mlx_flash.tools.cap import drop_page_cache, run_capped

from tqdm import tqdm

TASKS = {
    "summarise": "Summarise the following text in a few sentences, reusing its wording.\n\n{text}",
    "extract": "List every name, place and date mentioned in the following text, one per line, with the sentence "
    "it appears in.\n\n{text}",
    "edit": "Rewrite the following text with British spelling and without changing anything else.\n\n{text}",
    "story": "Once upon a time",  # no input to reuse: drafts come from the text so far (the random 7B repeats itself)
}


def passage(n_words: int = 170, skip: int = 3) -> str:
    """A WikiText-2 test paragraph of about n_words (the skip-th long enough one), detokenised lightly."""
    paras = [
        p.strip()
        for p in wikitext().read_text().split("\n")
        if len(p.split()) > n_words and not p.strip().startswith("=")
    ]
    words = paras[skip].split()[:n_words]
    text = " ".join(words)
    return (
        re.sub(r" @(.)@ ", r"\1", text).replace(" ,", ",").replace(" .", ".").replace(" 's", "'s").replace(" <unk>", "")
    )


def setup_arg_parser():
    p = argparse.ArgumentParser(description="Prompt lookup vs plain decoding on input-reusing tasks.")
    p.add_argument("--model", default=None, help="Flash directory (default: SmolLM2-135M-Instruct).")
    p.add_argument("--memory-budget", default="50%")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--draft-model", default=None, help="Also run with this draft model (a flash directory).")
    p.add_argument("--tasks", default=",".join(TASKS), help="Which tasks.")
    p.add_argument("--cap", action="store_true", help="Each run under a hard memory cap of budget + baseline.")
    p.add_argument("--json", default=None)
    return p


def run(model: str, budget: str, prompt: str, max_tokens: int, mode: str, draft=None, cap=None) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "mlx_flash.generate",
        "--model",
        model,
        "--memory-budget",
        budget,
        "--prompt",
        prompt,
        "--max-tokens",
        str(max_tokens),
        "--stats",
    ]
    cmd += {"plain": [], "prompt-lookup": ["--prompt-lookup"], "draft": ["--draft-model", str(draft)]}[mode]
    if cap is not None:
        res = run_capped(cmd, limit=cap, drop=[model], timeout=3600)
        if not res.ok:
            sys.exit(f"{mode} failed: {res.summary()}\n{res.stderr[-2000:]}")
        out = res.stdout
    else:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    text = out.split("\n==========\n")[0]
    res = {
        "text": text,
        "tps": float(re.search(r"Generation: \d+ tokens, ([\d.]+) tokens-per-sec", out).group(1)),
        "tokens": int(re.search(r"Generation: (\d+) tokens", out).group(1)),
    }
    m = re.search(r"speculative: (\d+) passes, (\d+) drafted, (\d+) accepted .*?, ([\d.]+) tokens a pass", out)
    if m:
        res.update(
            passes=int(m.group(1)),
            drafted=int(m.group(2)),
            accepted=int(m.group(3)),
            mean_accepted_length=float(m.group(4)),
        )
    return res


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    model = str(args.model or default_model_dir())
    text, tasks = passage(), args.tasks.split(",")
    modes = ["plain", "prompt-lookup"] + (["draft"] if args.draft_model else [])
    cap = None
    if args.cap:
        cap = (
            parse_size(args.memory_budget, FlashDir(model).model_bytes)
            + run_capped(memory.baseline_command(model)).max_rss
        )
    runs = []
    jobs = [
        (r, task, mode)
        for r in range(args.rounds)
        for task in tasks
        for mode in modes[r % len(modes) :] + modes[: r % len(modes)]
    ]
    for r, task, mode in tqdm(jobs, desc="speculative tasks", unit="run"):
        drop_page_cache([model])
        res = run(
            model, args.memory_budget, TASKS[task].format(text=text), args.max_tokens, mode, args.draft_model, cap
        )
        runs.append(dict(round=r, task=task, mode=mode, **res))
    print(
        f"{model}, budget {args.memory_budget}"
        + (f" (hard cap {cap / 2**20:.0f} MiB)" if cap else "")
        + f", {args.max_tokens} tokens, greedy; generation tokens/s by round"
    )
    print("| task | mode | tokens/s | speed-up (medians) | acceptance | tokens a pass | same text as plain |")
    print("|---|---|---|---|---|---|---|")
    for task in tasks:
        plain = [x for x in runs if x["task"] == task and x["mode"] == "plain"]
        for mode in modes:
            xs = [x for x in runs if x["task"] == task and x["mode"] == mode]
            ratio = statistics.median(x["tps"] for x in xs) / statistics.median(x["tps"] for x in plain)
            acc = xs[0]["accepted"] / xs[0]["drafted"] if xs[0].get("drafted") else 0.0
            same = all(x["text"] == plain[0]["text"] for x in xs)
            tps = ", ".join(f"{x['tps']:.1f}" for x in xs)
            print(
                f"| {task} | {mode} | {tps} | "
                f"**{ratio:.2f}x** | {acc:.0%} | {xs[0].get('mean_accepted_length', 1.0):.2f} | {same} |"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "model": model,
                    "budget": args.memory_budget,
                    "max_tokens": args.max_tokens,
                    "passage": text,
                    "tasks": TASKS,
                    "runs": runs,
                    "cap": cap,
                    "draft_model": args.draft_model,
                    "machine": machine_info(model),
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
