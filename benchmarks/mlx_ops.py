"""The MLX path's cost per decode step, counted: MLX operations and host synchronisations against stock mlx-lm's forward
on the same weights (what a Mac runs; this CPU's time says nothing of Metal's, the counts do).

    python benchmarks/mlx_ops.py [--out benchmarks/results/mlx_ops.json] [--budgets none,50%] \\
        [--models smollm2,llama-7b,qwen3-30b-a3b] [--layers 4]

Models: SmolLM2-135M (the default model) and the LLaMA-7B and Qwen3-30B-A3B shapes cut to --layers layers (synthetic
weights, uniform routing), each exported to a stock mlx-lm directory (mlx_flash.convert.export) for the reference.
A step is one decode token after a 16-token prompt, in MLX_FLASH_BACKEND=mlx's forward (MLXForward), at each budget;
beside it, one batched decode pass (forward.run, the server's) of 1 and of 8 sequences: what a sequence adds.

Operations: the primitives of every graph the step evaluates (mx.export_to_dot of what each evaluation computes:
mx.eval, mx.async_eval, and the host copies np.array / np.asarray make, intercepted), so fused kernels count once
(on the CPU backend MLX composes rms_norm, RoPE and attention from primitives: the stock forward's count includes
those too). Host synchronisations: evaluations with work to do before the host goes on (the step's final one
included; mx.async_eval queues work without waiting, and a later wait for it finds no graph left: not counted); the
engine's own counts beside (Stats.syncs, and Stats.waits: its waits for results already queued).
"""

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path

os.environ["MLX_FLASH_BACKEND"] = "mlx"  # before the package reads it

import mlx_flash  # noqa: E402, F401  (before mlx.core: loads OpenBLAS on Linux)

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
PROMPT = list(range(1, 17))
BATCHES = (1, 8)  # sequences in a counted batched pass
WARM = 48  # decode steps before the counted one (uniform routing: every expert a resident model holds, cached)


class Counter:
    """Counts the operations and synchronisations of the evaluations made while it is entered."""

    def __init__(self):
        self.ops = self.syncs = 0
        self.kinds = {}
        self._dot = tempfile.mktemp(suffix=".dot")
        self._saved = None

    def _graph(self, arrays, sync: bool = True) -> int:
        arrays = [a for a in arrays if isinstance(a, mx.array)]
        if not arrays:
            return 0
        mx.export_to_dot(self._dot, *arrays)
        labels = re.findall(r'label ="([^"]+)", shape=rectangle', Path(self._dot).read_text())
        for label in labels:
            self.kinds[label] = self.kinds.get(label, 0) + 1
        self.ops += len(labels)
        self.syncs += sync and bool(labels)
        return len(labels)

    def __enter__(self):
        ev, aev, array, asarray = mx.eval, mx.async_eval, np.array, np.asarray
        self._saved = ev, aev, array, asarray

        def flat(args):
            out = []
            for a in args:
                out += flat(a) if isinstance(a, (list, tuple)) else flat(a.values()) if isinstance(a, dict) else [a]
            return out

        mx.eval = lambda *a: (self._graph(flat(a)), ev(*a))[1]
        mx.async_eval = lambda *a: (self._graph(flat(a), sync=False), aev(*a))[1]
        np.array = lambda x, *a, **k: (self._graph([x]) if isinstance(x, mx.array) else 0, array(x, *a, **k))[1]
        np.asarray = lambda x, *a, **k: (self._graph([x]) if isinstance(x, mx.array) else 0, asarray(x, *a, **k))[1]
        return self

    def __exit__(self, *exc):
        mx.eval, mx.async_eval, np.array, np.asarray = self._saved


def step_counts(model, forward, warm: int) -> dict:
    """A decode step's counts in the steady state: the prompt and `warm` steps first (caches filled as the budget
    lets them, kernels built), then one counted."""
    cache = model.make_cache()
    mx.eval(forward(PROMPT, cache, True))
    token = 5
    for _ in range(warm):
        token = int(mx.argmax(forward([token], cache, False)[0, -1]).item())
    with Counter() as counter:
        token = mx.argmax(forward([token], cache, False)[0, -1])
        mx.eval(token)
    return {"ops": counter.ops, "syncs": counter.syncs, "ops_by_kind": dict(sorted(counter.kinds.items()))}


def batch_counts(model, forward, n: int) -> dict:
    """One decode pass of n sequences at once (forward.run, as the server's batches) after one uncounted (a mixer's
    first call over several sequences is checked against their calls alone): its counts."""
    caches = [model.make_cache() for _ in range(n)]
    for i, cache in enumerate(caches):
        mx.eval(forward([t + i for t in PROMPT], cache, True))
    forward.run([([4 + i], cache) for i, cache in enumerate(caches)])
    with Counter() as counter:
        forward.run([([5 + i], cache) for i, cache in enumerate(caches)])
    return {"sequences": n, "ops": counter.ops, "syncs": counter.syncs}


def stock(path) -> dict:
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = mlx_lm.load(str(path))
    caches = make_prompt_cache(model)  # (a function of the model: shadowed below for step_counts)
    model.make_cache = lambda: caches

    def forward(tokens, cache, prompt):
        return model(mx.array(tokens)[None], cache=cache)

    return step_counts(model, forward, 2)


def flash(path, budget) -> dict:
    from mlx_flash.loader import load

    model, _ = load(path, memory_budget=budget, context=128, backend="mlx")
    try:
        out = step_counts(model, model.forward, WARM)
        out["batched"] = [batch_counts(model, model.forward, n) for n in BATCHES]
        s = model.flash.stats
        s.end()
        out["engine_syncs"] = s.tokens[-1].syncs if s.tokens else None
        out["engine_waits"] = s.tokens[-1].waits if s.tokens else None
        out["layers"] = len(model.layers)
        out["plan"] = model.flash.plan.describe(
            {k: v.stride for k, v in model.flash.fd.layouts.items()},
            {k: r.n_units for k, r in next(l for l in model.flash.fd.layers if l).items()},
        )
        return out
    finally:
        model.flash.close()


def models(root: Path, layers: int, which) -> dict:
    from mlx_flash.convert.export import main as export
    from mlx_flash.default_model import default_model_dir
    from mlx_flash.tools.synthetic import build

    out = {"SmolLM2-135M": Path(default_model_dir())} if "smollm2" in which else {}
    if "llama-7b" in which:
        out[f"LLaMA-7B shape, {layers} layers"] = build(
            "llama-7b", root / "l7", progress=False, num_hidden_layers=layers, vocab_size=4096
        )
    if "qwen3-30b-a3b" in which:
        out[f"Qwen3-30B-A3B shape, {layers} layers, uniform routing"] = build(
            "qwen3-30b-a3b", root / "q30", progress=False, routing="uniform", num_hidden_layers=layers, vocab_size=4096
        )
    for name, path in out.items():
        export([str(path), "--out", str(root / (Path(path).name + "-mlx"))])
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description="MLX operations and host synchronisations per decode step.")
    p.add_argument("--out", default=str(HERE / "results" / "mlx_ops.json"))
    p.add_argument("--budgets", default="none,50%")
    p.add_argument("--layers", type=int, default=4, help="Layers of the 7B and 30B shapes (above 2: dense read-ahead)")
    p.add_argument("--models", default="smollm2,llama-7b,qwen3-30b-a3b")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(dir=HERE) as tmp:
        for name, path in models(Path(tmp), args.layers, args.models.split(",")).items():
            ref = stock(Path(tmp) / (Path(path).name + "-mlx"))
            for budget in args.budgets.split(","):
                got = flash(path, None if budget == "none" else budget)
                rows.append({"model": name, "budget": budget, "stock": ref, "mlx_flash": got})
                print(
                    f"{name}, budget {budget}: {got['ops']} ops ({got['ops'] / ref['ops']:.2f}x stock mlx-lm's "
                    f"{ref['ops']}), {got['syncs']} host synchronisations ({got['syncs'] / got['layers']:.2f} a layer; "
                    f"stock {ref['syncs']})",
                    flush=True,
                )
                one, many = got["batched"][0], got["batched"][-1]
                print(f"  a batched pass: {one['ops']} ops for 1 sequence, {many['ops']} for {many['sequences']}")
                report = {"mlx": mx.__version__, "device": str(mx.default_device()), "rows": rows}
                Path(args.out).write_text(json.dumps(report, indent=1))  # (after every row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
