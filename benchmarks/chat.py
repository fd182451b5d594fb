"""A five-turn chat through `python -m mlx_flash.server`, with the prompt cache on and off.

    python benchmarks/chat.py --memory-budget 50% --max-context 768 --out benchmarks/chat_smollm2.json

The first user message is ~350 tokens of WikiText-2 (mlx_flash.texts.read_text()), then four short
questions on the growing history (the model's own replies included). Each configuration starts
its own server process; per turn the client (http.client, streaming) measures the time to the first
token, decode tokens/s and the bytes the server process read at the device (/proc/PID/io
read_bytes). Greedy decoding, so every configuration sees the same history as long as their
tokens agree.
"""

import argparse
import http.client
import json
import os
import re
import subprocess
import sys
import time

from tqdm import tqdm

import mlx_flash  # noqa: F401
from mlx_flash.bench_io import machine_info
from mlx_flash.default_model import default_model_dir
from mlx_flash.flash_format import FlashDir
from mlx_flash.loader import load_tokenizer
from mlx_flash.texts import read_text

QUESTIONS = ["Who is the text about?", "What was his first role?", "Which theatre is named in the text?",
             "Summarise the text in one sentence."]
# name -> server flags; each runs the same conversation
CONFIGS = {
    "float KV, no prompt cache": ["--prompt-cache-size", "0"],
    "8-bit KV, no prompt cache": ["--kv-bits", "8", "--prompt-cache-size", "0"],
    "8-bit KV, prompt cache": ["--kv-bits", "8", "--prompt-cache-size", "1"],
}


def first_message(tokenizer, n_tokens: int = 350) -> str:
    ids = tokenizer.encode(read_text().strip())[:n_tokens]
    return "Read this text:\n\n" + tokenizer.decode(ids)


def read_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def start_server(model, args, flags):
    cmd = [sys.executable, "-m", "mlx_flash.server", "--model", str(model), "--port", "0",
           "--memory-budget", args.memory_budget, "--max-context", str(args.max_context), *flags]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stderr:
        lines.append(line)
        m = re.search(r"serving .* on http://[\d.]+:(\d+)/v1", line)
        if m:
            return proc, int(m.group(1)), "".join(lines)
    raise RuntimeError("the server did not start:\n" + "".join(lines))


def turn(port, pid, messages, max_tokens):
    """One streamed chat request: (reply, stats)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    body = {"messages": messages, "max_tokens": max_tokens, "stream": True, "temperature": 0.0,
            "stream_options": {"include_usage": True}}
    read0, t0 = read_bytes(pid), time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"{r.status}: {r.read().decode()}")
    text, first, usage = "", None, None
    for line in r:
        line = line.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue  # blank lines and mlx-lm's ": keepalive" comments during the prefill
        event = json.loads(line[6:])
        if "error" in event:
            raise RuntimeError(event["error"])
        usage = event.get("usage") or usage
        for choice in event["choices"]:
            content = choice.get("delta", {}).get("content")
            if content:
                first = first or time.perf_counter()
                text += content
    end = time.perf_counter()
    conn.close()
    n = usage["completion_tokens"]
    return text, {
        "prompt_tokens": usage["prompt_tokens"],
        "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
        "completion_tokens": n,
        "ttft_s": round(first - t0, 3),
        "decode_tok_s": round((n - 1) / (end - first), 3) if n > 1 and end > first else None,
        "device_bytes_read": read_bytes(pid) - read0,
    }


def run_config(model, args, name, flags, first):
    proc, port, log = start_server(model, args, flags)
    try:
        messages, turns = [], []
        for q in tqdm([first] + QUESTIONS, desc=name, leave=False):
            messages.append({"role": "user", "content": q})
            reply, stats = turn(port, proc.pid, messages, args.max_tokens)
            messages.append({"role": "assistant", "content": reply})
            turns.append(dict(stats, reply=reply))
        return {"flags": flags, "server_log": log.strip(), "turns": turns}
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def table(results) -> str:
    rows = ["| configuration | turn | prompt tokens | cached | TTFT s | decode tok/s | device MiB read |",
            "|---|---|---|---|---|---|---|"]
    for name, res in results.items():
        for i, t in enumerate(res["turns"], 1):
            rows.append(f"| {name} | {i} | {t['prompt_tokens']} | {t['cached_tokens']} | {t['ttft_s']:.1f} | "
                        f"{t['decode_tok_s'] or 0:.2f} | {t['device_bytes_read'] / 2**20:.1f} |")
    return "\n".join(rows)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="Flash directory (default: SmolLM2-135M-Instruct).")
    p.add_argument("--memory-budget", default="50%")
    p.add_argument("--max-context", type=int, default=768)
    p.add_argument("--max-tokens", type=int, default=32, help="Tokens per reply.")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--out", default=None, help="Write the results as JSON here.")
    args = p.parse_args()

    model = args.model or default_model_dir()
    first = first_message(load_tokenizer(FlashDir(model)))
    results = {name: run_config(model, args, name, CONFIGS[name], first) for name in args.configs}
    print(table(results))
    if args.out:
        out = {"model": str(model), "memory_budget": args.memory_budget, "max_context": args.max_context,
               "max_tokens": args.max_tokens, "questions": QUESTIONS, "machine": machine_info(str(model)),
               "results": results}
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
