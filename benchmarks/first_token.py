"""Time to the first token under a hard cap: each prompt length in a new process under a cap of budget + baseline,
page cache of the model dropped first; held-out WikiText-2 as the prompt. Reported per run: time to the first token
(from the call; loading apart), prompt tokens/s, passes, prompt chunk, bytes read at the device by the prompt, peak
RSS above the baseline (`--no-cap`: uncapped, for bytes and passes). `--checkouts` runs other checkouts of mlx_flash
(PYTHONPATH) in the same rounds, alternating; `--gguf` runs llama.cpp on the same weights in them too (llama-bench's
prompt test, cold: no warm-up run, mmap, no repacking, 2 threads), under the same cap.

    python benchmarks/first_token.py --model DIR --memory-budget 25% --lengths 512,2048 --rounds 3 \
        --checkouts .,/tmp/before --gguf FILE --json benchmarks/results/first_token_qwen3_30b.json
"""

import argparse
import json
import os
import statistics
import sys
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
from mlx_flash.tools.peers_systems import llama_bench_cmd, versions

LLAMA = "llama.cpp mmap"


def child(args) -> dict:
    """One process's prompt (the --child mode): its row as JSON on stdout's last line."""
    from mlx_flash.generate import generate_step
    from mlx_flash.loader import load, load_tokenizer
    from mlx_flash.texts import read_text

    import mlx.core as mx

    prompt = load_tokenizer(FlashDir(args.model)).encode(read_text(half="second"))[: args.length]
    model, _ = load(args.model, memory_budget=args.memory_budget, backend=args.backend, context=len(prompt) + 16)
    engine = model.flash
    step = engine.plan.prefill_step(engine.fd, engine.context, model.forward.native)
    start = time.perf_counter()
    next(generate_step(mx.array(prompt), model, max_tokens=1, prefill_step_size=step))
    ttft = time.perf_counter() - start
    engine.stats.end()  # (the last pass's record)
    passes = [t for t in engine.stats.tokens if t.prefill] or engine.stats.tokens
    peak = engine.stats.peak_rss()
    engine.close()
    return {
        "length": len(prompt),
        "backend": args.backend,
        "forward": model.forward.name,
        "prefill_step": step,
        "ttft_s": ttft,
        "prompt_tps": len(prompt) / ttft,
        "passes": len(passes),
        "bytes_read": sum(t.bytes_read for t in passes),
        "peak_rss_above_baseline": peak,
        "budget": engine.plan.budget,
    }


def capped(cmd, cap, path, **kw):
    """(run_capped's result, the row of what it measured): `cmd` under `cap`, page cache of `path` dropped first."""
    res = run_capped(cmd, limit=cap, drop=[path], timeout=7200, **kw)
    row = {"ok": res.ok, "returncode": res.returncode, "oom_killed": res.oom_killed, "max_rss": res.max_rss}
    row.update(device_read_bytes=res.read_bytes, wall_s=res.wall_s)
    if not res.ok:
        row["error"] = res.stderr[-1500:]
    return res, row


def flash_row(args, checkout: str, length: int, backend: str, cap) -> dict:
    """A child process of `checkout` (PYTHONPATH) prefilling `length` tokens, page cache of the model dropped first,
    under `cap`."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", args.model]
    cmd += ["--memory-budget", args.memory_budget, "--length", length, "--backend", backend]
    env = {**os.environ, "PYTHONPATH": checkout}
    res, row = capped(cmd, cap, args.model, env=env, cwd=checkout)
    return row if not res.ok else {**row, **json.loads(res.stdout.strip().splitlines()[-1])}


def llama_row(gguf: Path, length: int, cap) -> dict:
    """llama-bench's prompt test of `length` tokens, page cache of the GGUF dropped first, under `cap`."""
    cmd = llama_bench_cmd(gguf, prompt=length, extra=["--no-warmup", "--repack", 0, "-lm", "mmap"])
    res, row = capped(cmd, cap, gguf)
    if not res.ok:
        return row
    ttft = json.loads(res.stdout)[-1]["avg_ns"] / 1e9
    row.update(forward="llama.cpp", ttft_s=ttft, prompt_tps=length / ttft, passes=None, prefill_step=None)
    return {**row, "bytes_read": res.read_bytes}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--memory-budget", default="25%")
    p.add_argument("--lengths", default="512,2048")
    p.add_argument("--backends", default="auto")
    p.add_argument("--checkouts", default=".", help="mlx_flash checkouts to run, comma-separated (PYTHONPATH).")
    p.add_argument("--gguf", type=Path, default=None, help="llama.cpp's run of the same weights, in the same rounds.")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-cap", action="store_true", help="No hard cap (bytes and passes; peak RSS recorded).")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--backend", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    fd = FlashDir(args.model)
    baseline = run_capped(memory.baseline_command(args.model)).max_rss
    cap = parse_size(args.memory_budget, fd.model_bytes) + baseline
    out = {"command": " ".join(["python", *sys.argv]), "machine": machine_info(args.model), "versions": versions()}
    out.update(model=args.model, budget=args.memory_budget, cap=None if args.no_cap else cap, baseline=baseline)
    out.update(runs=[], summary=[])
    out["fio_start"] = fio_reference(fd.largest_unit_path, DEFAULT_THREADS)
    checkouts = [str(Path(c).resolve()) for c in args.checkouts.split(",")] + ([LLAMA] if args.gguf else [])
    for r in range(args.rounds):
        for length in map(int, args.lengths.split(",")):
            for checkout in checkouts if r % 2 == 0 else checkouts[::-1]:  # (alternating)
                for backend in [None] if checkout == LLAMA else args.backends.split(","):
                    row = {"round": r, "checkout": checkout, "length": length, "backend": backend}
                    if checkout == LLAMA:
                        row.update(llama_row(args.gguf, length, None if args.no_cap else cap))
                    else:
                        row.update(flash_row(args, checkout, length, backend, None if args.no_cap else cap))
                    out["runs"].append(row)
                    print(json.dumps(row), flush=True)
    out["fio_end"] = fio_reference(fd.largest_unit_path, DEFAULT_THREADS)
    for key in dict.fromkeys((x["length"], x["backend"], x["checkout"]) for x in out["runs"]):
        rows = [x for x in out["runs"] if (x["length"], x["backend"], x["checkout"]) == key]
        done = [x for x in rows if x["ok"]]
        out["summary"].append({
            "length": key[0], "backend": key[1], "checkout": key[2], "runs": len(rows), "ok": len(done),
            "ttft_s": statistics.median(x["ttft_s"] for x in done) if done else None,
            "prompt_tps": statistics.median(x["prompt_tps"] for x in done) if done else None,
            "passes": done[0]["passes"] if done else None,
            "prefill_step": done[0]["prefill_step"] if done else None,
            "bytes_read": statistics.median(x["bytes_read"] for x in done) if done else None,
            "peak_rss": max(x["max_rss"] for x in done) if done else None,
        })  # fmt: skip
    print(json.dumps(out["summary"], indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
