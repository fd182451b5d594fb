"""Prompt-lookup speculative decoding against plain decoding on tasks that reuse their input (issue #25).

    python benchmarks/prompt_lookup.py [--model DIR] --memory-budget 50% --rounds 3 --max-tokens 160 [--json out.json]

Each task gives the model a text of its own (a WikiText-2 test passage, from the package's copy) and asks it
to summarise, extract or edit it. Per round and task, plain decoding and `--prompt-lookup` run alternately,
each in a fresh `python -m mlx_flash.generate` process (the user's command, greedy) with the page cache of the
directory dropped first; the figures are generate's own generation tokens/s and its speculative stats. The
outputs are compared: greedy speculative decoding must give the plain tokens.
"""

import argparse
import json
import re
import statistics
import subprocess
import sys

from tqdm import tqdm

from mlx_flash.default_model import default_model_dir
from mlx_flash.texts import wikitext
from mlx_flash.tools.bench_io import machine_info
from mlx_flash.tools.cap import drop_page_cache

TASKS = {
    "summarise": "Summarise the following text in a few sentences, reusing its wording.\n\n{text}",
    "extract": "List every name, place and date mentioned in the following text, one per line, with the sentence "
               "it appears in.\n\n{text}",
    "edit": "Rewrite the following text with British spelling and without changing anything else.\n\n{text}",
}


def passage(n_words: int = 170, skip: int = 3) -> str:
    """A WikiText-2 test paragraph of about n_words (the skip-th long enough one), detokenised lightly."""
    paras = [p.strip() for p in wikitext().read_text().split("\n") if len(p.split()) > n_words and not p.strip().startswith("=")]
    words = paras[skip].split()[:n_words]
    text = " ".join(words)
    return re.sub(r" @(.)@ ", r"\1", text).replace(" ,", ",").replace(" .", ".").replace(" 's", "'s").replace(" <unk>", "")


def setup_arg_parser():
    p = argparse.ArgumentParser(description="Prompt lookup vs plain decoding on input-reusing tasks.")
    p.add_argument("--model", default=None, help="Flash directory (default: SmolLM2-135M-Instruct).")
    p.add_argument("--memory-budget", default="50%")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    return p


def run(model: str, budget: str, prompt: str, max_tokens: int, lookup: bool) -> dict:
    cmd = [sys.executable, "-m", "mlx_flash.generate", "--model", model, "--memory-budget", budget, "--prompt", "-",
           "--max-tokens", str(max_tokens), "--stats"] + (["--prompt-lookup"] if lookup else [])
    out = subprocess.run(cmd, input=prompt, capture_output=True, text=True, check=True).stdout
    text = out.split("\n==========\n")[0]
    res = {"text": text, "tps": float(re.search(r"Generation: \d+ tokens, ([\d.]+) tokens-per-sec", out).group(1)),
           "tokens": int(re.search(r"Generation: (\d+) tokens", out).group(1))}
    m = re.search(r"speculative: (\d+) passes, (\d+) drafted, (\d+) accepted .*?, ([\d.]+) tokens a pass", out)
    if m:
        res.update(passes=int(m.group(1)), drafted=int(m.group(2)), accepted=int(m.group(3)),
                   mean_accepted_length=float(m.group(4)))
    return res


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    model = str(args.model or default_model_dir())
    text = passage()
    runs = []
    jobs = [(r, task, lookup) for r in range(args.rounds) for task in TASKS
            for lookup in ((False, True) if r % 2 == 0 else (True, False))]
    for r, task, lookup in tqdm(jobs, desc="prompt lookup", unit="run"):
        drop_page_cache([model])
        res = run(model, args.memory_budget, TASKS[task].format(text=text), args.max_tokens, lookup)
        runs.append(dict(round=r, task=task, lookup=lookup, **res))
    print(f"{model}, budget {args.memory_budget}, {args.max_tokens} tokens, greedy; generation tokens/s by round")
    print("| task | plain | prompt lookup | speed-up (medians) | acceptance | tokens a pass | same text |")
    print("|---|---|---|---|---|---|---|")
    for task in TASKS:
        plain = [x for x in runs if x["task"] == task and not x["lookup"]]
        look = [x for x in runs if x["task"] == task and x["lookup"]]
        ratio = statistics.median(x["tps"] for x in look) / statistics.median(x["tps"] for x in plain)
        acc = look[0]["accepted"] / look[0]["drafted"] if look[0].get("drafted") else 0.0
        same = all(x["text"] == plain[0]["text"] for x in plain + look)
        tps = {k: ", ".join(f"{x['tps']:.1f}" for x in xs) for k, xs in (("plain", plain), ("lookup", look))}
        print(f"| {task} | {tps['plain']} | {tps['lookup']} | **{ratio:.2f}x** | {acc:.0%} | "
              f"{look[0].get('mean_accepted_length', 0):.2f} | {same} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": model, "budget": args.memory_budget, "max_tokens": args.max_tokens, "passage": text,
                       "tasks": TASKS, "runs": runs, "machine": machine_info(model)}, f, indent=1)


if __name__ == "__main__":
    main()
