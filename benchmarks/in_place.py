"""Experts read in place from an mlx-community-style source against the same experts copied into ffn.bin: what
convert writes, the same bits, and decode speed under hard memory caps.

    python benchmarks/in_place.py --source MLXDIR --copied FLASHDIR --out INPLACEDIR --caps 25%,50% \
        --budgets 25%,50%,100% --tokens 32 --rounds 3 --json benchmarks/results/in_place_qwen3_30b.json

--copied is a flash directory holding the same weights in ffn.bin (e.g. the one MLXDIR was exported from with
`python -m mlx_flash.convert.export`, or `convert --copy`). Steps:
  1. convert (unless --out exists): `python -m mlx_flash.convert --model MLXDIR --out INPLACEDIR` (in place, the
     default), the filesystem's used bytes sampled every millisecond: peak extra disk, bytes of the output, wall time;
  2. the same bits: per budget (a fraction of the model's bytes), in a fresh process each, teacher-forced random
     tokens through both directories: every log-probability equal, and the greedy continuation of a prompt;
  3. decode speed: per round, both directories in alternating order, under each hard cap (a child memory cgroup of
     that fraction of the model's bytes, the unit files' page cache dropped first), no budget flag (`auto`): forced
     random tokens (routing as varied as the random router gives: "own" routing of a uniform-routing synthetic
     model), tokens/s, bytes read a token, hit rate, reported per form as medians over rounds; fio on both files.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import mlx_flash  # noqa: F401  (OpenBLAS before mlx.core)
from mlx_flash.format.directory import FlashDir
from mlx_flash.io.reader import DEFAULT_THREADS
from mlx_flash.peers import fio_reference
from mlx_flash.tools.bench_io import machine_info
from mlx_flash.tools.cap import run_capped
from mlx_flash.tools.peers_systems import versions

from convert_disk import convert_sampled  # (beside this script)

_SAME = """
import gc, json, sys
import numpy as np
import mlx_flash  # noqa: F401
import mlx.core as mx
from mlx_flash.format.directory import FlashDir
from mlx_flash.generate import generate_step
from mlx_flash.loader import load
dirs, fraction, n = sys.argv[1:3], float(sys.argv[3]), int(sys.argv[4])
out = []
for d in dirs:
    fd = FlashDir(d)
    budget = None if fraction >= 1 else int(fraction * fd.model_bytes)
    model, _ = load(d, memory_budget=budget, context=2 * n + 16)
    ids = np.random.default_rng(0).integers(0, fd.config["vocab_size"], n)
    cache = model.make_cache()
    logprobs = [np.array(mx.softmax(model(mx.array([[int(t)]]), cache=cache)[0, -1].astype(mx.float32), precise=True))
                for t in ids]
    greedy = [int(t) for t, _ in generate_step(mx.array(ids[:8]), model, max_tokens=n)]
    out.append((np.stack(logprobs), greedy))
    model.flash.close()
    del model, cache
    gc.collect()
    mx.clear_cache()
print(json.dumps({"logprobs_equal": bool(np.array_equal(out[0][0], out[1][0])), "greedy_equal": out[0][1] == out[1][1],
                  "max_abs_diff": float(np.abs(out[0][0] - out[1][0]).max())}))
"""

_DECODE = """
import json, statistics, sys, time
import numpy as np
import mlx_flash  # noqa: F401
import mlx.core as mx
from mlx_flash.loader import load
model_dir, n = sys.argv[1], int(sys.argv[2])
model, _ = load(model_dir, context=n + 16)  # no budget: auto, from the cgroup
e = model.flash
ids = np.random.default_rng(0).integers(0, e.fd.config["vocab_size"], n + 1)
cache = model.make_cache()
times = []
for t in ids:
    tic = time.perf_counter()
    mx.eval(model.forward([int(t)], cache))  # (the pass generate runs: native where it can, else MLX's)
    times.append(time.perf_counter() - tic)
e.stats.end()
toks = e.stats.tokens[1:]
hits, misses = sum(t.hits for t in toks), sum(t.misses for t in toks)
print(json.dumps({"tok_s": (len(times) - 1) / sum(times[1:]), "budget": e.plan.budget,
                  "hit_rate": hits / max(1, hits + misses),
                  "bytes_per_token": statistics.median(t.bytes_read for t in toks),
                  "requested_per_token": statistics.median(t.bytes_requested for t in toks),
                  "io_ms": 1e3 * statistics.median(t.io_s for t in toks), "peak_rss": e.stats.peak_rss()}))
"""


def child(script: str, *args, limit=None, drop=()) -> dict:
    r = run_capped([sys.executable, "-c", script, *map(str, args)], limit=limit, drop=drop, timeout=3600)
    if r.returncode:
        return {"returncode": r.returncode, "oom_killed": r.oom_killed, "stderr_tail": r.stderr[-600:]}
    return {**json.loads(r.stdout.strip().splitlines()[-1]), "cgroup_peak": r.cgroup_peak}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", required=True, help="An mlx-community-style directory (experts stacked).")
    p.add_argument("--copied", required=True, help="A flash directory with the same experts in ffn.bin.")
    p.add_argument("--out", required=True, help="The in-place flash directory (converted here unless it exists).")
    p.add_argument("--caps", default="25%,50%", help="Hard caps, fractions of the model's bytes.")
    p.add_argument("--budgets", default="25%,50%,100%", help="Budgets of the same-bits check.")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--phases", default="convert,same,speed", help="What to run (a --json's other phases are kept).")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    phases = args.phases.split(",")
    source, copied, out = (Path(x).expanduser().resolve() for x in (args.source, args.copied, args.out))
    report = json.loads(Path(args.json).read_text()) if args.json and Path(args.json).exists() else {}
    report.update(machine=machine_info(str(copied)), versions=versions())
    earlier = report.get("tokens") if isinstance(report.get("tokens"), dict) else {}  # (tokens of each phase)
    report["tokens"] = {**earlier, **{ph: args.tokens for ph in phases if ph != "convert"}}
    if "convert" in phases:
        if out.exists():
            raise SystemExit(f"{out} exists: remove it to convert again, or leave convert out of --phases")
        report["convert"] = convert_sampled(source, out)
        print(json.dumps(report["convert"], indent=1), flush=True)
    fd, ref = FlashDir(out), FlashDir(copied)
    fraction = {b: float(b.rstrip("%")) / 100 for b in args.budgets.split(",") + args.caps.split(",")}
    if "same" in phases:
        report["same_bits"] = {}
        for b in args.budgets.split(","):
            report["same_bits"][b] = child(_SAME, out, copied, fraction[b], args.tokens)
            print(b, report["same_bits"][b], flush=True)
    if "speed" in phases:
        speed(report, args, fd, ref, out, copied, fraction)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


def speed(report, args, fd, ref, out, copied, fraction):
    report["fio_start"] = {"in_place": fio_reference(fd.largest_unit_path, DEFAULT_THREADS),
                           "copied": fio_reference(ref.largest_unit_path, DEFAULT_THREADS)}  # fmt: skip
    runs = []
    forms = {"in_place": (out, fd.unit_paths), "copied": (copied, ref.unit_paths)}
    for r in range(args.rounds):
        order = list(forms) if r % 2 == 0 else list(forms)[::-1]
        for cap in args.caps.split(","):
            for form in order:
                d, files = forms[form]
                limit = int(fraction[cap] * fd.model_bytes)
                run = {"round": r, "form": form, "cap": cap, "limit": limit}
                run.update(child(_DECODE, d, args.tokens, limit=limit, drop=[d, *files]))
                runs.append(run)
                print(json.dumps(run), flush=True)
    report["runs"] = runs
    report["medians"] = {
        f"{form} {cap}": {
            k: statistics.median(x[k] for x in runs if x["form"] == form and x["cap"] == cap and k in x)
            for k in ("tok_s", "bytes_per_token", "hit_rate", "io_ms")
        }
        for form in forms
        for cap in args.caps.split(",")
    }
    for cap in args.caps.split(","):
        m = report["medians"]
        report["medians"][f"ratio {cap}"] = m[f"in_place {cap}"]["tok_s"] / m[f"copied {cap}"]["tok_s"]
    report["fio_end"] = {"in_place": fio_reference(fd.largest_unit_path, DEFAULT_THREADS),
                         "copied": fio_reference(ref.largest_unit_path, DEFAULT_THREADS)}  # fmt: skip
    print(json.dumps(report["medians"], indent=1))


if __name__ == "__main__":
    main()
