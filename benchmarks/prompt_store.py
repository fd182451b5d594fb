"""Time to the first token with prompts cached on disk (engine/prompt_store.py): per forward, three new processes,
each under a hard cap of budget + baseline with the page cache of the model and the store dropped first:

  cold   the prompt (held-out WikiText-2, --tokens) followed by --new tokens, no store;
  store  the prompt alone, storing its KV cache (--prompt-cache-dir);
  warm   the prompt followed by the --new tokens, reading the stored prefix.

Reported: time to the first token (from the call to the first token; loading apart), tokens read from the store,
its bytes, and whether warm's tokens and log-probabilities equal cold's bit for bit. Rounds alternate; medians.

    python benchmarks/prompt_store.py --model DIR --memory-budget 50% --tokens 2000 --new 20 --backends auto,mlx \
        --rounds 3 --json benchmarks/results/prompt_store_smollm2.json
"""

import argparse
import hashlib
import json
import shutil
import statistics
import sys
import tempfile
import time
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

GENERATED = 8


def child(args) -> dict:
    """One process's run (the --child mode): the row as JSON on stdout's last line."""
    from mlx_flash.engine.prompt_store import PromptStore, identity
    from mlx_flash.generate import generate_step
    from mlx_flash.loader import load, load_tokenizer
    from mlx_flash.texts import read_text

    import mlx.core as mx
    import numpy as np

    tokens = load_tokenizer(FlashDir(args.model)).encode(read_text(half="second"))[: args.tokens + args.new]
    prompt = tokens[: args.tokens] if args.phase == "store" else tokens
    start = time.perf_counter()
    model, _ = load(args.model, memory_budget=args.memory_budget, backend=args.backend, context=len(tokens) + 64)
    loaded = time.perf_counter() - start
    store = PromptStore(args.store, identity(model)) if args.phase != "cold" else None
    step = model.flash.plan.prefill_step(model.flash.fd, model.flash.context, model.forward.native)
    start, first, out, lps = time.perf_counter(), None, [], []
    steps = generate_step(mx.array(prompt), model, max_tokens=GENERATED, prefill_step_size=step, prompt_store=store)
    for t, lp in steps:
        first = first or time.perf_counter() - start
        out.append(t)
        lps.append(np.array(lp))
    model.flash.close()
    return {
        "phase": args.phase,
        "backend": args.backend,
        "forward": model.forward.name,
        "prompt_tokens": len(prompt),
        "prefill_step": step,
        "load_s": loaded,
        "ttft_s": first,
        "tokens": out,
        "logprobs_sha256": hashlib.sha256(np.stack(lps).tobytes()).hexdigest(),
        "read_from_store": store.tokens_read if store else 0,
        "store_bytes": store.nbytes() if store else 0,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--memory-budget", default="50%")
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--new", type=int, default=20)
    p.add_argument("--backends", default="auto,mlx")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    p.add_argument("--backend", default=None, help=argparse.SUPPRESS)
    p.add_argument("--store", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    fd = FlashDir(args.model)
    baseline = run_capped(memory.baseline_command(args.model)).max_rss
    cap = parse_size(args.memory_budget, fd.model_bytes) + baseline
    out = {"command": " ".join(["python", *sys.argv]), "machine": machine_info(args.model), "versions": versions()}
    out.update(model=args.model, budget=args.memory_budget, cap=cap, baseline=baseline, runs=[], summary={})
    out["fio_start"] = fio_reference(fd.largest_unit_path, DEFAULT_THREADS)
    for r in range(args.rounds):
        for backend in args.backends.split(","):
            store = Path(tempfile.mkdtemp(prefix="prompt_store_"))
            try:
                rows = {}
                for phase in ("cold", "store", "warm"):
                    cmd = [sys.executable, __file__, "--child", "--model", args.model, "--memory-budget"]
                    cmd += [args.memory_budget, "--tokens", args.tokens, "--new", args.new, "--phase", phase]
                    cmd += ["--backend", backend, "--store", store]
                    res = run_capped(cmd, limit=cap, drop=[args.model, store], timeout=7200)
                    if not res.ok:
                        raise SystemExit(f"{phase} ({backend}) failed: {res.stderr[-2000:]}")
                    rows[phase] = {**json.loads(res.stdout.strip().splitlines()[-1]), "round": r}
                    print(json.dumps(rows[phase]), flush=True)
                cold, warm = rows["cold"], rows["warm"]
                warm["same_tokens"] = warm["tokens"] == cold["tokens"]
                warm["same_logprobs"] = warm["logprobs_sha256"] == cold["logprobs_sha256"]
                warm["ttft_vs_cold"] = warm["ttft_s"] / cold["ttft_s"]
                out["runs"] += rows.values()
            finally:
                shutil.rmtree(store, ignore_errors=True)
    for backend in args.backends.split(","):
        warm = [w for w in out["runs"] if w["backend"] == backend and w["phase"] == "warm"]
        cold = [w for w in out["runs"] if w["backend"] == backend and w["phase"] == "cold"]
        out["summary"][backend] = {
            "cold_ttft_s": statistics.median(c["ttft_s"] for c in cold),
            "warm_ttft_s": statistics.median(w["ttft_s"] for w in warm),
            "warm_vs_cold": statistics.median(w["ttft_vs_cold"] for w in warm),
            "read_from_store": warm[0]["read_from_store"],
            "store_bytes": warm[0]["store_bytes"],
            "all_same_tokens_and_logprobs": all(w["same_tokens"] and w["same_logprobs"] for w in warm),
        }
    out["fio_end"] = fio_reference(fd.largest_unit_path, DEFAULT_THREADS)
    print(json.dumps(out["summary"], indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
