"""Active-set traces: record which FFN neurons a real model uses per token, replay them anywhere.

    python -m mlx_flash.calib.trace [--model DIR] [--sparsity oracle] [--density 0.2] [--tokens 256] --out trace.npz

Recording runs the model (default: SmolLM2, `default_model.default_model_dir()`) over real text
(WikiText-2 test by default) with every FFN resident, in one teacher-forced forward pass,
captures each layer's FFN input per token and asks the sparsifier which neurons it selects.
So a trace holds the per-token, per-layer active sets the runtime would see on that text
(oracle: the top-K of the true |GLU| at `density`; sketch: the directory's calibrated sketch, top-K
of its estimate at `density`; predictor: its predictions; dense: all). DIP is not recorded (its
two-step selection needs the dip layout).

Saved as .npz: `active` = np.packbits of a bool [tokens, layers, neurons] array along the
neuron axis, `tokens` (ids), and `meta` (JSON: model, sparsifier, density, text offset, and
`selector`: what chose the sets and its DRAM, see `selector_info`).

Mapping onto a larger model (`MappedTrace`, used by the synthetic benchmarks):

* layers: big layer j replays small layer floor(j * L_small / L_big) (proportional);
* neurons: the big layer's n_big neurons are split into n_small blocks of ~n_big/n_small
  neurons; block i belongs to small neuron i, and the blocks are made of a FIXED RANDOM set of
  big-layer neurons (a seeded permutation, different per big layer). A big neuron is active
  exactly when its small neuron is. This keeps, per token and layer, the density (up to
  rounding of the block sizes), the hot-neuron skew (a hot small neuron makes its whole block
  hot) and the reuse across tokens (the same blocks recur when the small sets recur); the
  random placement keeps the active neurons scattered over the layer's region on flash as in
  a real model (no locality is invented). When n_big < n_small, each big neuron follows one
  small neuron (a random subset), which preserves density in expectation.
* tokens: step t replays trace token t mod T.

Replay: `TraceSparsifier(trace)` has the Dense/Oracle interface (`select(layer, x, cached)`
-> sorted int32 ids) and ignores x. It keeps a call counter per layer, so the prefill's cache
seeding (the last `window` prompt tokens, layer by layer) and decoding (one call per layer per
token) both walk the trace in order. Load the model with sparsity="dense" and set
`model.flash.sparsifier = TraceSparsifier(...)`.

Its `nbytes` is the DRAM the recorded selector would keep on the model replaying the trace, for
the budget plan: a sketch's bytes per gate/up weight times that model's gate/up weights. The
oracle's trace is the upper bound and counts nothing (deploying it would take its own dense
gate/up copy).
"""

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

import mlx_flash  # noqa: F401  (OpenBLAS before mlx.core)

import mlx.core as mx
import numpy as np

from ..default_model import cache_root, default_model_dir
from ..engine.sparsity import top_k
from ..format.directory import FlashDir
from ..loader import load_resident, load_tokenizer, make_sparsifier
from ..texts import read_text


class Trace:
    """Per-token, per-layer active sets of one model: `active` bool [tokens, layers, neurons]."""

    def __init__(self, active: np.ndarray, tokens: Optional[np.ndarray] = None, meta: Optional[dict] = None):
        self.active = np.asarray(active, dtype=bool)
        self.tokens = np.asarray(tokens if tokens is not None else [], dtype=np.int32)
        self.meta = dict(meta or {})

    n_tokens = property(lambda self: self.active.shape[0])
    n_layers = property(lambda self: self.active.shape[1])
    n_units = property(lambda self: self.active.shape[2])

    def ids(self, t: int, layer: int) -> np.ndarray:
        return np.flatnonzero(self.active[t % self.n_tokens, layer]).astype(np.int32)

    def density(self) -> float:
        return float(self.active.mean())

    def save(self, path) -> Path:
        path = Path(path)
        np.savez_compressed(
            path,
            active=np.packbits(self.active, axis=-1),
            n_units=self.n_units,
            tokens=self.tokens,
            meta=json.dumps(self.meta),
        )
        return path if path.suffix == ".npz" else path.with_name(path.name + ".npz")

    @staticmethod
    def load(path) -> "Trace":
        with np.load(path) as z:
            n = int(z["n_units"])
            active = np.unpackbits(z["active"], axis=-1, count=n).astype(bool)
            return Trace(active, z["tokens"], json.loads(str(z["meta"])))

    def reuse(self, window: int = 1) -> float:
        """Mean share of a token's active neurons that were active in one of the previous `window` tokens."""
        a = self.active
        shares = []
        for t in range(window, a.shape[0]):
            prev = a[t - window : t].any(axis=0)
            n = a[t].sum()
            if n:
                shares.append((a[t] & prev).sum() / n)
        return float(np.mean(shares)) if shares else 0.0


class MappedTrace:
    """A Trace replayed on a model with `n_layers` layers of `n_units` neurons (see module docstring)."""

    def __init__(self, trace: Trace, n_layers: int, n_units: int, seed: int = 0):
        self.trace, self.n_layers, self.n_units = trace, n_layers, n_units
        self.layer_map = (np.arange(n_layers) * trace.n_layers // n_layers).astype(np.int64)
        base = (np.arange(n_units, dtype=np.int64) * trace.n_units // n_units).astype(np.int32)
        rng = np.random.default_rng(seed)
        # owner[l][b]: the small neuron whose activity big neuron b follows
        self.owner = [base[rng.permutation(n_units)] for _ in range(n_layers)]
        self.n_tokens = trace.n_tokens

    def mask(self, t: int, layer: int) -> np.ndarray:
        small = self.trace.active[t % self.trace.n_tokens, self.layer_map[layer]]
        return small[self.owner[layer]]

    def ids(self, t: int, layer: int) -> np.ndarray:
        return np.flatnonzero(self.mask(t, layer)).astype(np.int32)


def as_mapped(trace, n_layers: int, n_units: int, seed: int = 0):
    """`trace` itself when the shapes match (exact replay), else a MappedTrace."""
    if isinstance(trace, Trace) and (trace.n_layers, trace.n_units) == (n_layers, n_units):
        return trace
    base = trace.trace if isinstance(trace, MappedTrace) else trace
    return MappedTrace(base, n_layers, n_units, seed)


def gate_up_weights(fd) -> int:
    """Weights a selector's low-bit copy covers: every layer's gate and up (fc1 without a GLU)."""
    per_layer = fd.ffn["hidden_size"] * fd.ffn["intermediate_size"]
    return len(fd.layers) * per_layer * (2 if fd.ffn["kind"] == "glu" else 1)


def selector_info(sp, fd) -> dict:
    """meta["selector"] of a trace recorded with `sp` on `fd`. A sketch's DRAM is kept per gate/up
    weight (its input scales, 4 bytes a column, are included: ~0.2%), so it scales to any model."""
    if sp.name == "sketch":
        w = gate_up_weights(fd)
        return {
            "name": "sketch",
            "bits": sp.bits,
            "group_size": sp.group_size,
            "nbytes": int(sp.nbytes),
            "gate_up_weights": w,
            "bytes_per_weight": sp.nbytes / w,
        }
    if sp.name == "oracle":
        return {"name": "oracle", "upper_bound": True}
    return {"name": sp.name}


def selector_nbytes(meta: dict, weights: Optional[int] = None) -> int:
    """DRAM the selector that recorded a trace keeps on a model of `weights` gate/up weights (None: the
    recording model's); 0 when the trace records no cost (the oracle's: the upper bound)."""
    sel = meta.get("selector") or {}
    if "bytes_per_weight" not in sel:
        return 0
    return round(sel["bytes_per_weight"] * (sel["gate_up_weights"] if weights is None else weights))


def describe_selector(meta: dict) -> str:
    """The recorded selector, for tables: e.g. "sketch 4-bit (group 64)", "oracle (upper bound, not deployable)"."""
    sel = meta.get("selector") or {"name": meta.get("sparsity", "?")}  # traces from before meta["selector"]
    if sel["name"] == "sketch":
        return (
            f"sketch {sel['bits']}-bit (group {sel['group_size']}, {sel['bytes_per_weight']:.3f} B per gate/up weight)"
        )
    if sel["name"] == "oracle":
        return "oracle (upper bound, not deployable)"
    return sel["name"] if sel["name"] == "dense" else f"{sel['name']} (its DRAM not counted)"


class TraceSparsifier:
    """Replays recorded active sets: select(layer, x, cached) -> sorted int32 ids (x is ignored).

    `weights`: the replaying model's gate/up weights (`gate_up_weights`), for `nbytes` (module doc)."""

    name = "trace"

    def __init__(
        self, trace, n_layers: int = None, n_units: int = None, seed: int = 0, start: int = 0, weights: int = None
    ):
        if isinstance(trace, (str, Path)):
            trace = Trace.load(trace)
        if n_layers is not None:
            trace = as_mapped(trace, n_layers, n_units, seed)
        self.trace = trace
        self.meta = (trace.trace if isinstance(trace, MappedTrace) else trace).meta
        self.nbytes = selector_nbytes(self.meta, weights)
        self.start = start
        self.calls = {}

    def select(self, layer: int, x=None, cached=None) -> np.ndarray:
        k = self.calls.get(layer, 0)
        self.calls[layer] = k + 1
        return self.trace.ids(self.start + k, layer)

    def reset(self, start: int = None):
        self.calls = {}
        if start is not None:
            self.start = start


class RecordingSparsifier:
    """Wraps a sparsifier and records its decode-time selections (runtime replays / tests)."""

    def __init__(self, inner, n_layers: int, n_units: int):
        self.inner, self.log = inner, [[] for _ in range(n_layers)]
        self.n_units = n_units

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def select(self, layer, x, cached=None):
        ids = self.inner.select(layer, x, cached)
        self.log[layer].append(np.asarray(ids))
        return ids

    def to_trace(self, meta=None) -> Trace:
        t = min(len(v) for v in self.log)
        active = np.zeros((t, len(self.log), self.n_units), dtype=bool)
        for layer, sets in enumerate(self.log):
            for i in range(t):
                active[i, layer, sets[i]] = True
        return Trace(active, meta=meta)


class _Capture:
    def __init__(self, mlp, sink):
        self.mlp, self.sink = mlp, sink

    def __call__(self, x):
        self.sink.append(np.array(x.astype(mx.float32)).reshape(-1, x.shape[-1]))
        return self.mlp(x)


def record(
    path=None,
    sparsity: str = "oracle",
    density: Optional[float] = 0.2,
    tokens: int = 256,
    text: Optional[str] = None,
    offset: int = 0,
) -> Trace:
    """Record a Trace of the model at `path` (default: SmolLM2) on `tokens` tokens of `text`
    (default: WikiText-2 test, from character `offset`). sparsity "sketch": the directory's calibrated
    sketch, at `density` (None: its calibrated densities), one token at a time as the runtime asks it."""

    path = path if path is not None else default_model_dir()
    model, fd = load_resident(path, mx.float32)
    if text is None:
        text = read_text()
    tok = load_tokenizer(fd)
    ids = tok.encode(text[offset : offset + 20 * tokens])[:tokens]
    if len(ids) < tokens:
        raise ValueError(f"the text gives only {len(ids)} tokens, {tokens} asked")
    sinks = [[] for _ in model.layers]
    for layer, sink in zip(model.layers, sinks):
        layer.mlp = _Capture(layer.mlp, sink)  # plain attribute: the module tree is not needed any more
    mx.eval(model(mx.array(ids)[None]))
    sp = make_sparsifier(fd, sparsity, density)
    n = fd.ffn["intermediate_size"]
    active = np.zeros((len(ids), len(sinks), n), dtype=bool)
    for layer, sink in enumerate(sinks):
        x = sink[0]
        if sparsity == "oracle" and density is not None:  # batched: one projection for all tokens
            h = np.abs(sp.activations(layer, x))
            for t in range(len(ids)):
                active[t, layer, top_k(h[t], round(density * n))] = True
        else:
            for t in range(len(ids)):
                active[t, layer, sp.select(layer, x[t])] = True
    meta = {
        "model": str(path),
        "sparsity": sparsity,
        "density": density,
        "tokens": len(ids),
        "text": "wikitext-2 test" if text is None or offset >= 0 else "custom",
        "offset": offset,
        "realised_density": float(active.mean()),
        "selector": selector_info(sp, fd),
    }
    return Trace(active, np.array(ids), meta)


def default_trace(density: float = 0.2, tokens: int = 256, model=None):
    """The SmolLM2 trace on WikiText-2 (recorded once, cached): of the selector the directory ships (its
    calibrated sketch) if it has one, else the oracle's (the upper bound). `model`: another directory."""

    fd = FlashDir(model if model is not None else default_model_dir())
    sel = (fd.manifest.get("sparsity") or {}).get("selector") or {}
    sparsity, tag = (
        ("sketch", f"sketch{sel['bits']}b-g{sel['group_size']}")
        if sel.get("name") == "sketch"
        else ("oracle", "oracle")
    )
    root = cache_root() / "traces"
    path = root / f"{'smollm2' if model is None else fd.path.name}-{tag}-{density:g}-{tokens}.npz"
    if not path.is_file():
        root.mkdir(parents=True, exist_ok=True)
        print(f"[trace] recording the {tag} trace of {fd.path} into {path} (once)", file=sys.stderr)
        record(fd.path, sparsity, density, tokens).save(path)
    return Trace.load(path), path


def setup_arg_parser():
    p = argparse.ArgumentParser(description="Record per-layer FFN active sets of a model on real text.")
    p.add_argument("--model", default=None, help="Flash directory (default: SmolLM2, converted once).")
    p.add_argument(
        "--sparsity",
        default="oracle",
        choices=["oracle", "sketch", "predictor", "dense"],
        help="sketch: the directory's calibrated sketch (python -m mlx_flash.calibrate --selector sketch).",
    )
    p.add_argument(
        "--density",
        type=float,
        default=0.2,
        help="oracle / sketch: share of neurons kept per token (top-K of |GLU| / of the sketch's estimate).",
    )
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--offset", type=int, default=0, help="Character offset into WikiText-2 test.")
    p.add_argument("--out", required=True)
    return p


def main():
    a = setup_arg_parser().parse_args()
    tr = record(
        a.model, a.sparsity, a.density if a.sparsity in ("oracle", "sketch") else None, a.tokens, offset=a.offset
    )
    out = tr.save(a.out)
    print(
        f"wrote {out}: {describe_selector(tr.meta)}, "
        f"{tr.n_tokens} tokens x {tr.n_layers} layers x {tr.n_units} neurons, "
        f"density {tr.density():.3f}, reuse from the previous token {tr.reuse(1):.1%}, "
        f"from the last 5 {tr.reuse(5):.1%}"
    )


if __name__ == "__main__":
    main()
