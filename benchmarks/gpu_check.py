"""A GPU run, prepared: where MLX has a GPU backend (Metal, CUDA), the models streamed through MLX's forward give the
resident model's tokens, and a Qwen3-30B-A3B-shaped token is timed in its parts.

    python benchmarks/gpu_check.py [--out benchmarks/results/gpu_check.json] [--layers 4] [--steps 8] [--cpu]

1. Same tokens: SmolLM2 (the default model), a tiny 4-bit qwen3_moe and a tiny qwen3moe GGUF of the Q2_K mix (its
   GGML blocks read as stored), greedy, 24 tokens of a prompt, resident and streamed at 50% and 25% of their size:
   tokens and log-probabilities against the resident run's.
2. A Qwen3-30B-A3B-shaped token (the preset's widths, --layers layers, uniform routing, synthetic weights) at 25% and
   50% of its size: per decode step its time, its reads (bytes, and the time waited for them), the host
   synchronisations a layer, then in an instrumented pass (each part evaluated on its own, so slower in all) the
   router's and the experts' time a layer.

Where neither mx.metal.is_available() nor mx.cuda.is_available(), it prints one line and exits 0 (--cpu runs it on
MLX's CPU backend anyway: the script's own check, not a GPU figure). The JSON records the device and MLX's version.
"""

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import mlx_flash  # noqa: F401  (before mlx.core: loads OpenBLAS on Linux)
from mlx_flash.engine.experts import ExpertEngine
from mlx_flash.generate import generate_step
from mlx_flash.loader import load

import mlx.core as mx
import numpy as np

PROMPT = "The history of the city begins with a small harbour, where"


def gpu() -> str:
    """The GPU backend MLX has here ("metal", "cuda"), or ""."""
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    return "cuda" if cuda is not None and cuda.is_available() else ""


def greedy(model, tok, n: int):
    ids = mx.array(tok.encode(PROMPT))
    out = [(int(t), np.array(lp.astype(mx.float32))) for t, lp in generate_step(ids, model, max_tokens=n)]
    return [t for t, _ in out], [lp for _, lp in out]


def budgets(path) -> dict:
    """name -> budget: SmolLM2 at 50% and 25% of its size; a tiny model (whose fixed parts outweigh its units) at its
    resident floor plus 50% and 25% of its FFN units."""
    if path is None:
        return {"resident": None, "50%": "50%", "25%": "25%"}
    from mlx_flash.budget import min_budget
    from mlx_flash.format.directory import FlashDir
    from mlx_flash.loader import kv_size_of

    fd = FlashDir(path)
    floor = min_budget(fd, 256, kv_size_of(fd))
    return {
        "resident": None,
        "floor + 50% of the units": floor + fd.ffn_bytes // 2,
        "floor + 25%": floor + fd.ffn_bytes // 4,
    }


def same_tokens(path, n: int) -> dict:
    """Greedy tokens streamed at 50% and 25% against the resident run's."""
    out, ref = {}, None
    for name, budget in budgets(path).items():
        model, tok = load(path, memory_budget=budget, context=256)
        try:
            tokens, lps = greedy(model, tok, n)
            streamed = [g.path for g in model.flash.plan.streamed]
        finally:
            model.flash.close()
        if ref is None:
            ref = (tokens, lps)
        out[name] = {
            "tokens": tokens,
            "same_tokens": tokens == ref[0],
            "same_logprobs": all(np.array_equal(a, b) for a, b in zip(lps, ref[1])),
            "max_logprob_difference": max(float(np.abs(a - b).max()) for a, b in zip(lps, ref[1])),
            "streamed_resident_weights": streamed,
        }
        print(f"  {'SmolLM2' if path is None else path.parent.name} {name}: same tokens {tokens == ref[0]}")
    return out


def tiny_moe(root: Path) -> Path:
    from mlx_flash.convert.build import convert
    from mlx_flash.tools.synthetic import tiny_quantized

    return convert(str(tiny_quantized("qwen3_moe", root, num_hidden_layers=4)), root / "flash", progress=False)


def tiny_k_quant_moe(root: Path) -> Path:
    """A tiny qwen3moe GGUF of llama-quantize's Q2_K mix, in place: its experts and resident matrices (attention,
    head, embedding) computed over the file's GGML blocks (a GPU's decode steps: kernels/ggml_blocks.metal)."""
    from mlx_flash.convert.build import convert
    from mlx_flash.tools.synthetic_gguf import tiny_moe as shape
    from mlx_flash.tools.synthetic_gguf import write_gguf

    root.mkdir(parents=True)
    src = write_gguf(
        "moe-small", root / "m.gguf", progress=False, gguf_type="Q2_K",
        **{**shape("qwen3_moe"), "hidden_size": 256, "moe_intermediate_size": 256, "num_hidden_layers": 4},
    )  # fmt: skip
    return convert(str(src), root / "flash", progress=False)


class Timed:
    """A callable timed with its output evaluated (the instrumented pass): seconds per call, appended."""

    def __init__(self, fn, times: list):
        self.fn, self.times = fn, times

    def __call__(self, *args, **kwargs):
        mx.eval(args[0])  # (its input, so that the part's own time is what is measured)
        t = time.perf_counter()
        out = self.fn(*args, **kwargs)
        mx.eval(out)
        self.times.append(time.perf_counter() - t)
        return out


def moe_token(path: Path, budget: str, steps: int) -> dict:
    """A Qwen3-30B-A3B-shaped model's decode steps at `budget`: the plain steps' medians, then an instrumented pass's
    router and expert times a layer."""
    model, _ = load(path, memory_budget=budget, context=64)
    try:
        layers = len(model.layers)
        cache = model.make_cache()
        model.forward(list(range(1, 17)), cache, prompt=True)
        stats = model.flash.stats
        stats.reset()
        token = 5
        for _ in range(steps):
            token = int(mx.argmax(model.forward([token], cache)[0, -1]).item())
        stats.end()
        s = stats.summary()
        routers, experts = [], []
        gate = type(next(layer.mlp.gate for layer in model.layers if hasattr(layer.mlp, "gate")))
        router, switch = gate.__call__, ExpertEngine._switch
        gate.__call__ = lambda self, x: Timed(lambda x: router(self, x), routers)(x)
        ExpertEngine._switch = lambda self, *a, **k: Timed(lambda *a, **k: switch(self, *a, **k), experts)(*a, **k)
        try:
            for _ in range(2):
                token = int(mx.argmax(model.forward([token], cache)[0, -1]).item())
        finally:
            gate.__call__, ExpertEngine._switch = router, switch
        return {
            "budget": budget,
            "layers": layers,
            "token_ms": s["total_ms"],
            "io_wait_ms": s["io_ms"],
            "bytes_per_token": s["bytes_per_token"],
            "hit_rate": s["hit_rate"],
            "syncs_per_layer": s["syncs_per_token"] / layers,
            "router_ms_per_layer": 1e3 * float(np.median(routers)) if routers else None,
            "experts_ms_per_layer": 1e3 * float(np.median(experts)) if experts else None,
        }
    finally:
        model.flash.close()


def setup_arg_parser():
    p = argparse.ArgumentParser(description="Same tokens and a 30B-shaped token's parts on MLX's GPU backend.")
    p.add_argument("--out", default=None, help="JSON to write (default: print only).")
    p.add_argument("--layers", type=int, default=4, help="Layers of the Qwen3-30B-A3B-shaped model.")
    p.add_argument("--steps", type=int, default=8, help="Decode steps timed.")
    p.add_argument("--tokens", type=int, default=24, help="Greedy tokens compared.")
    p.add_argument("--cpu", action="store_true", help="Run on MLX's CPU backend where there is no GPU (a check).")
    return p


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    device = gpu()
    if not device and not args.cpu:
        print("gpu_check: skipped, MLX has no GPU backend here (mx.metal and mx.cuda unavailable)")
        return 0
    from mlx_flash.tools.synthetic import build

    report = {"device": device or "cpu", "mlx": mx.__version__, "machine": platform.platform()}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        print("same tokens, resident against streamed:")
        report["smollm2"] = same_tokens(None, args.tokens)
        report["tiny_moe"] = same_tokens(tiny_moe(tmp / "moe"), args.tokens)
        report["tiny_moe_q2_k"] = same_tokens(tiny_k_quant_moe(tmp / "q2_k"), args.tokens)
        shape = build(
            "qwen3-30b-a3b", tmp / "q30", progress=False, routing="uniform", num_hidden_layers=args.layers,
            vocab_size=4096,
        )  # fmt: skip
        report["qwen3_30b_a3b_shape"] = [moe_token(shape, b, args.steps) for b in ("25%", "50%")]
        for r in report["qwen3_30b_a3b_shape"]:
            print(f"Qwen3-30B-A3B shape, {r['layers']} layers at {r['budget']}: {r}")
    ok = all(v["same_tokens"] for m in ("smollm2", "tiny_moe", "tiny_moe_q2_k") for v in report[m].values())
    report["same_tokens"] = ok
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"gpu_check on {report['device']}: tokens {'the same' if ok else 'DIFFER'} at every budget")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
