"""Sparse evaluation on a resident float32 model: active sets applied as masks, perplexity, statistics.

The streaming runtime decodes one token at a time; measuring perplexity that way on a
2-core CPU is far too slow. Instead every FFN of a resident model is replaced by an
`EvalFFN` holding its weights dequantised to float32 (plain matmuls, no slow CPU
quantised matmuls), and the per-token active set of a sparsifier is applied as a mask:

    glu:  y = W_down (m_out * act(W_gate (m_in * x)) * (W_up (m_in * x)))
    relu: y = W_fc2 (m_out * relu(W_fc1 x + b1)) + b2

A masked-out neuron / input column contributes exactly what the runtime skips, so the
result equals the runtime's output for the same active sets (up to float rounding). The masks
come from the runtime's own selector objects (mlx_flash.engine.sparsity, `Controller.selector`) applied
to all of a sequence's rows at once: the units measured here are the units the runtime picks.
Modes (`Controller.mode`):

    dense      no masks
    oracle     m_out = top-K of the true |GLU| (ReLU: h > 0, identical to dense)
    predictor  m_out = sigmoid(B A x) > threshold (low-rank predictors)
    dip        m_in = top-K of |x|, m_out = top-K of |GLU of the pruned input| (DIP)
    dip-ca     DIP with cache-aware scores (DIP eq. 10): a per-layer LFU UnitCache is
               simulated token by token (the runtime's cache class, no bytes moved), and
               |x| / |GLU| of units not in the cache are scaled by gamma before top-K.
    wina       DIP with |x_j| scaled by ||[gate; up][:, j]|| and |GLU_i| by ||down[:, i]||
    sketch     m_out = top-K of |act(G~ x) * (U~ x)|, G~ / U~ the sketch's low-bit gate / up
               (the runtime's Sketch, quantised matmuls on the sketch's own codes)

The controller also counts selected units (the realised density) and, for cached modes,
misses (the units a runtime with that cache would read), and can record each FFN input
x for calibration (`record=True`).
"""

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from tqdm import tqdm

from ..compute import cpu_gemv
from ..compute.ffn import ACTIVATIONS
from ..engine.cache import UnitCache
from ..engine.sparsity import DIP, WINA, Oracle, Predictor, Sketch, top_k_mask
from ..format.directory import FlashDir, dense_ffn_weights  # noqa: F401  (re-exported: calibrate, reorder, tests)
from ..loader import build_model

MODES = ("dense", "oracle", "predictor", "dip", "dip-ca", "wina", "sketch")
DIP_MODES = ("dip", "dip-ca", "wina")  # prune gate/up inputs first


# -- weights -----------------------------------------------------------------------------
def unit_strides(fd: FlashDir) -> Dict[str, int]:
    """Bytes on flash per unit of each region ("neurons", and "inputs" for the dip layout)."""
    return {name: r.stride for name, r in fd.layers[0].items()}


# -- the masked FFN and its controller ---------------------------------------------------
class EvalFFN(nn.Module):
    """Replaces layers[i].mlp: the layer's FFN in float32 with the controller's masks."""

    def __init__(self, ctl: "Controller", layer: int, weights: Dict[str, mx.array], bias: Dict[str, mx.array]):
        super().__init__()
        self._ctl, self._layer, self._w = ctl, layer, weights
        self._bias = {k: v.astype(mx.float32) for k, v in bias.items()}

    def __call__(self, x):
        return self._ctl.forward(self._layer, x, self._w, self._bias).astype(x.dtype)


@dataclass
class Controller:
    """Which units each token uses, for every EvalFFN of one model; plus counters and recording."""

    kind: str
    activation: str
    n_layers: int
    mode: str = "dense"
    density: float = 1.0  # oracle: fraction of neurons kept
    predictors: Optional[List[Dict[str, mx.array]]] = None
    threshold: float = 0.5
    predictor_density: Optional[float] = None  # set: top-K predictor logits per token, not the threshold
    input_norm: Optional[List[np.ndarray]] = None  # wina
    neuron_norm: Optional[List[np.ndarray]] = None  # wina
    sketch: Optional[Sketch] = None  # the runtime's sketch selector
    input_density: Optional[List[float]] = None  # dip
    neuron_density: Optional[List[float]] = None  # dip
    gamma: float = 0.2  # dip-ca
    cache_fraction: float = 0.5  # dip-ca and miss counting: LFU cache holding this share of each region's units
    record: bool = False
    xs: List[list] = field(default_factory=list)
    count_misses: bool = False

    def __post_init__(self):
        self._selector = self.selector()
        self.reset_counters()
        self.xs = [[] for _ in range(self.n_layers)]
        self._caches = None

    def reset_counters(self):
        self.tokens = np.zeros(self.n_layers, dtype=np.int64)
        self.selected = {"inputs": np.zeros(self.n_layers), "neurons": np.zeros(self.n_layers)}
        self.missed = {"inputs": np.zeros(self.n_layers), "neurons": np.zeros(self.n_layers)}
        self.sizes = {}

    def set_mode(self, mode: str, **kw):
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r} (choose from {', '.join(MODES)})")
        self.mode = mode
        for k, v in kw.items():
            setattr(self, k, v)
        self._selector = self.selector()
        self.reset_counters()

    def new_sequence(self):
        """Cold caches (called before each evaluated sequence)."""
        self._caches = None

    # -- densities ---------------------------------------------------------------
    def realised(self) -> Dict[str, np.ndarray]:
        """Per layer fraction of inputs / neurons selected per token, and the MLP density
        (2 * input + neuron) / 3 (GLU; ReLU and non-dip modes: the neuron fraction)."""
        t = np.maximum(self.tokens, 1)
        d_in = self.selected["inputs"] / t / max(self.sizes.get("inputs", 1), 1)
        d_out = self.selected["neurons"] / t / max(self.sizes.get("neurons", 1), 1)
        if "inputs" not in self.sizes:
            d_in = np.ones(self.n_layers) if self.kind == "glu" and self.mode in DIP_MODES else d_out
        mlp = (2 * d_in + d_out) / 3 if self.kind == "glu" else d_out
        return {"input": d_in, "neuron": d_out, "mlp": mlp}

    # -- forward -------------------------------------------------------------------
    def selector(self):
        """The runtime's selector object (mlx_flash.engine.sparsity) for the mode, or None (dense): the one code that
        picks units, here applied to whole sequences at once."""
        m = self.mode
        if m == "oracle":  # ReLU: the non-zero activations, which the ReLU itself gives
            return Oracle(None, self.density, resident=False) if self.kind == "glu" else None
        if m == "predictor":
            return Predictor(self.predictors, self.threshold, self.predictor_density)
        if m == "sketch":
            return self.sketch  # a sparsity.Sketch (selectors.build_sketch's arrays)
        if m in DIP_MODES:
            if m == "wina":
                return WINA(self.input_density, self.neuron_density, self.input_norm, self.neuron_norm)
            return DIP(self.input_density, self.neuron_density, self.gamma if m == "dip-ca" else 1.0)
        return None

    def forward(self, layer: int, x: mx.array, w: Dict[str, mx.array], bias: Dict[str, mx.array]) -> mx.array:
        shape = x.shape
        xf = x.astype(mx.float32).reshape(-1, shape[-1])
        T = xf.shape[0]
        if self.record:
            self.xs[layer].append(np.array(xf))
        self.tokens[layer] += T
        if self.kind == "glu":
            y = self._glu(layer, xf, w)
        else:
            y = self._relu(layer, xf, w, bias)
        return y.reshape(*shape[:-1], y.shape[-1])

    def masks(self, layer: int, region: str, a: np.ndarray) -> Optional[np.ndarray]:
        """bool [T, n]: the units of `region` the selector picks for each row of `a` (inputs: the FFN inputs;
        neurons: the FFN inputs, or the GLU for DIP / WINA / the oracle); None: all of them. dip-ca picks token
        by token against a simulated LFU cache, as the runtime's cache would steer it."""
        sel = self._selector
        if sel is None:
            return None
        if self.mode == "dip-ca":
            cache = self._cache(layer, region, a.shape[-1])
            pick = sel.input_masks if region == "inputs" else sel.neuron_masks
            out = np.zeros(a.shape, dtype=bool)
            for t in range(a.shape[0]):
                out[t] = pick(layer, a[t : t + 1], cache.cached_mask())[0]
                ids = np.flatnonzero(out[t]).astype(np.int32)
                self.missed[region][layer] += len(ids) - int(cache.contains(ids).sum())
                cache.plan(ids)
            return out
        if region == "inputs":
            return sel.input_masks(layer, a)
        if self.mode in DIP_MODES or self.mode == "oracle":
            return sel.neuron_masks(layer, a)
        return sel.masks(layer, a)

    def _glu(self, layer, x, w):
        act = ACTIVATIONS[self.activation]
        n, d = w["gate"].shape
        self.sizes["neurons"] = n
        if self.mode in DIP_MODES:
            self.sizes["inputs"] = d
            x = x * self._apply(layer, "inputs", x)
        h = act(x @ w["gate"].T) * (x @ w["up"].T)
        m_out = self._apply(layer, "neurons", h if self.mode in DIP_MODES or self.mode == "oracle" else x, n)
        return h @ w["down"] if m_out is None else (h * m_out) @ w["down"]

    def _relu(self, layer, x, w, bias):
        n = w["fc1"].shape[0]
        self.sizes["neurons"] = n
        h = x @ w["fc1"].T
        if "fc1" in bias:
            h = h + bias["fc1"]
        h = mx.maximum(h, 0)
        m = self._apply(layer, "neurons", x, n)
        if m is None:
            m = (h > 0).astype(mx.float32)  # what a ReLU model needs: the non-zero neurons
            self._count(layer, "neurons", np.array(h) > 0)
        y = (h * m) @ w["fc2"]
        if "fc2" in bias:
            y = y + bias["fc2"]
        return y

    def _apply(self, layer, region, a: mx.array, n: Optional[int] = None) -> Optional[mx.array]:
        """The float32 mask of `masks` for the rows a, counted (selected units, and misses when asked); None:
        every unit (dense: nothing leaves MLX)."""
        if self._selector is None:
            if self.kind == "glu":
                self.selected[region][layer] += a.shape[0] * (n or a.shape[-1])
            return None
        m = self.masks(layer, region, np.array(a))
        self._count(layer, region, m)
        return mx.array(m.astype(np.float32))

    def _count(self, layer, region, m: np.ndarray):
        self.selected[region][layer] += float(m.sum())
        if self.count_misses and self.mode != "dip-ca":  # dip-ca counted its own
            self._count_misses(layer, region, m, m.shape[-1])

    # -- caches (dip-ca, and miss counting) -------------------------------------------
    def _cache(self, layer: int, region: str, n: int) -> UnitCache:
        if self._caches is None:
            self._caches = [dict() for _ in range(self.n_layers)]
        c = self._caches[layer].get(region)
        if c is None:
            c = UnitCache(n, max(1, round(self.cache_fraction * n)), 512, policy="lfu", alignment=512)
            self._caches[layer][region] = c
        return c

    def _count_misses(self, layer, region, masks: np.ndarray, n: int):
        cache = self._cache(layer, region, n)
        for row in masks:
            sel = np.flatnonzero(row).astype(np.int32)
            self.missed[region][layer] += len(sel) - int(cache.contains(sel).sum())
            cache.plan(sel)


def eval_model(fd: FlashDir, **controller_kw):
    """(model, controller): a resident float32 model of `fd` whose FFNs are EvalFFNs (nothing quantised)."""
    from mlx_lm.utils import dequantize_model

    ctl = Controller(fd.ffn["kind"], fd.ffn["activation"], len(fd.layers), **controller_kw)

    def make_ffn(i, bias):
        return EvalFFN(ctl, i, dense_ffn_weights(fd, i), bias)

    model = dequantize_model(cpu_gemv.with_biases(build_model(fd, make_ffn)))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model, ctl


def collect_inputs(model, ctl, batches: np.ndarray, progress: bool = False) -> List[np.ndarray]:
    """Run the dense model over `batches` and return each layer's FFN inputs [T, d] (float32)."""
    ctl.set_mode("dense", record=True)
    ctl.xs = [[] for _ in range(ctl.n_layers)]
    for row in tqdm(batches, desc="collect", unit="seq", disable=not progress):
        mx.eval(model(mx.array(row[None, :-1])))
    ctl.record = False
    xs = [np.concatenate(x) for x in ctl.xs]
    ctl.xs = [[] for _ in range(ctl.n_layers)]
    return xs


# -- perplexity -----------------------------------------------------------------------------
def sequence_nll(model, ctl: Optional[Controller], batches: np.ndarray, first: int = 0, on_logits=None) -> float:
    """Mean next-token negative log-likelihood over the batches (one sequence per forward, cold caches).

    Each row is scored from the prediction at position `first` on: 0 (texts.token_batches) scores
    every token after the first; n_ctx // 2 scores what llama-perplexity scores (texts.llama_ppl_chunks).
    ctl None: any model (e.g. mlx-lm's). on_logits(i, logits [n scored, vocab] float32): called per row."""
    total, count = 0.0, 0
    for i, row in enumerate(batches):
        if not 0 <= first < row.shape[0] - 1:
            raise ValueError(f"first={first} leaves nothing to score in a row of {row.shape[0]} tokens")
        if ctl is not None:
            ctl.new_sequence()
        x = mx.array(row[None, :-1])
        logits = model(x)[:, first:].astype(mx.float32)
        loss = nn.losses.cross_entropy(logits, mx.array(row[None, first + 1 :]), reduction="sum")
        total += float(loss.item())
        count += row.shape[0] - 1 - first
        if on_logits is not None:
            on_logits(i, logits[0])
    return total / count


def perplexity(model, ctl: Optional[Controller], batches: np.ndarray, first: int = 0, on_logits=None) -> float:
    return float(np.exp(sequence_nll(model, ctl, batches, first, on_logits)))


# -- activation statistics -------------------------------------------------------------------
def glu_activations(x: mx.array, w: Dict[str, mx.array], activation: str) -> mx.array:
    return ACTIVATIONS[activation](x @ w["gate"].T) * (x @ w["up"].T)


def activation_targets(
    x: np.ndarray, w: Dict[str, mx.array], kind: str, activation: str, density: float, bias: Optional[mx.array] = None
) -> np.ndarray:
    """bool [T, n]: which neurons a token needs. ReLU: h > 0; GLU: top-K of |GLU| at `density`."""
    xm = mx.array(x)
    if kind == "glu":
        h = mx.abs(glu_activations(xm, w, activation))
        return top_k_mask(np.array(h), round(density * h.shape[-1]))
    h = xm @ w["fc1"].T
    if bias is not None:
        h = h + bias
    return np.array(h > 0)


def layer_statistics(
    x: np.ndarray,
    w: Dict[str, mx.array],
    kind: str,
    activation: str,
    density: float,
    bias: Optional[mx.array] = None,
    hot: int = 32,
) -> dict:
    """Firing frequency per neuron, |activation| quantiles, and co-activation of the `hot` most frequent neurons."""
    xm = mx.array(x)
    if kind == "glu":
        h = np.abs(np.array(glu_activations(xm, w, activation)))
    else:
        hh = xm @ w["fc1"].T
        h = np.array(mx.maximum(hh + bias if bias is not None else hh, 0))
    fires = activation_targets(x, w, kind, activation, density, bias)
    freq = fires.mean(axis=0)
    order = np.argsort(-freq)[:hot]
    f = fires[:, order].astype(np.float32)
    co = (f.T @ f) / max(len(f), 1)  # P(i and j active)
    indep = np.outer(freq[order], freq[order])
    off = ~np.eye(len(order), dtype=bool)
    return {
        "freq": freq,
        "density": float(fires.mean()),
        "magnitude_quantiles": {str(q): float(np.quantile(h, q)) for q in (0.5, 0.9, 0.99, 0.999)},
        "hot_neurons": order.tolist(),
        "hot_coactivation_lift": float((co[off] / np.maximum(indep[off], 1e-9)).mean()) if len(order) > 1 else 1.0,
        "share_of_activations_in_top10pct": float(
            np.sort(freq)[::-1][: max(1, len(freq) // 10)].sum() / max(freq.sum(), 1e-9)
        ),
    }
