"""Sparsifiers: which FFN units each token uses. The one place that decides "which neurons".

    dense      every neuron (the paper's hybrid baseline)
    oracle     exact: ReLU neurons with non-zero activation; GLU neurons with non-zero
               GLU output (nearly all), or with `density` the top-K of the true |GLU|
               (DIP's "GLU pruning (oracle)"). A test instrument: it keeps its own copy
               of fc1 / gate+up, outside the memory budget.
    predictor  low-rank sigmoid(B(A x)) > threshold per layer (LLM in a flash, sec. 3.1)
    dip        Dynamic Input Pruning (needs the dip layout): top-K of |x| picks gate/up
               input columns, top-K of the pruned |GLU| picks down rows; with gamma < 1
               the scores prefer cached units (DIP-CA).
    wina       weight-aware DIP (WINA): DIP with input j scored |x_j| ||[gate; up][:, j]|| and
               neuron i |h_i| ||down[:, i]|| (dip layout; resident: two norm vectors a layer).
    sketch     top-K of |act(g~) u~|, g~ and u~ from resident low-bit copies of gate and up
               (neurons layout): the estimate ranks neurons, the runtime reads their exact rows.

On the dip layout every sparsifier drives `select_inputs` / `select_neurons`; dense and oracle
take every input column there, so the GLU they see is exact (the oracle needs no copy).

A sparsifier sees the FFN input of one token (x [d], float32 numpy) and returns
sorted unit ids (int32). DIP needs the gate/up result to choose down rows, so
FlashMLP drives it in two steps (`select_inputs`, `select_neurons`).

Each choice is made by one batched method (`masks`, `input_masks`, `neuron_masks`: rows [T, d] ->
bool [T, n]); the runtime's `select*` of one token is that method on one row, and calib.quality
evaluates the same objects on whole sequences: what calibration measures is what the runtime picks.
Scores that are matmuls (predictor, sketch) are computed a row at a time, because a BLAS product of
a batch rounds differently from one of a single row and near-ties would swap.
"""

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import mlx.core as mx
import numpy as np

from ..compute.ffn import ACTIVATIONS, project
from .cache import cache_aware_scores

SPARSITIES = ("dense", "oracle", "predictor", "dip", "wina", "sketch")
LOSSY = ("predictor", "dip", "wina", "sketch")  # need a calibration; dense and oracle serve every directory


def top_k_mask(scores: np.ndarray, k: int) -> np.ndarray:
    """bool [..., n]: the k largest scores of each row."""
    n = scores.shape[-1]
    k = max(0, min(int(k), n))
    mask = np.full(scores.shape, k == n)
    if 0 < k < n:
        np.put_along_axis(mask, np.argpartition(-scores, k - 1, axis=-1)[..., :k], True, axis=-1)
    return mask


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest scores, sorted by index (int32)."""
    return _ids(top_k_mask(scores, k))


def _ids(mask: np.ndarray) -> np.ndarray:
    return np.flatnonzero(mask).astype(np.int32)


def _rows(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)[None]


def _by_row(x: np.ndarray, score) -> np.ndarray:
    """float32 [T, n]: score(row [1, d] mx.array) of each row of x, evaluated together."""
    out = [score(mx.array(r[None])) for r in np.asarray(x, dtype=np.float32)]
    return np.array(mx.concatenate(out).astype(mx.float32))


def dram_bytes(sparsifier) -> int:
    """The DRAM a sparsifier holds, which every budget plan counts (load's and the bench's alike): a calibrated
    selector's arrays, the oracle's own copy of gate/up (a reference, but its bytes are in memory all the same),
    what a replayed trace's selector would keep on the replaying model; dense holds nothing."""
    return int(getattr(sparsifier, "nbytes", 0))


def pass_units(chosen: List[np.ndarray]):
    """(units, mask) of a pass over several positions, each with its own active set `chosen[i]`: the union is read
    once; mask (float32 [positions, units], None when every set is the same) keeps each position to its own units,
    so it is computed as a decode step of it alone would be."""
    active = chosen[0]
    if all(len(c) == len(active) and np.array_equal(c, active) for c in chosen[1:]):
        return active, None
    active = np.unique(np.concatenate(chosen)).astype(np.int32)
    return active, np.stack([np.isin(active, c) for c in chosen]).astype(np.float32)


def prompt_units(sparsifier, layer: int, rows, n: int) -> np.ndarray:
    """The units a prompt's FFN uses, for all of its tokens: the union of their active sets, or every unit once that
    union passes half the layer (reading the rest in one sequential sweep costs no more, and long prompts get the
    dense FFN). rows(): the prompt's FFN inputs on the host, [tokens, d] (called only if a selector needs them)."""
    everything = np.arange(n, dtype=np.int32)
    if isinstance(sparsifier, Dense):
        return everything
    seen = np.zeros(n, dtype=bool)
    for v in rows():
        seen[sparsifier.select(layer, v)] = True
        if seen.sum() > n // 2:
            return everything
    return _ids(seen)


class Dense:
    name = "dense"

    def __init__(self, n_units: int):
        self.n = n_units
        self._all = np.arange(n_units, dtype=np.int32)
        self._all.flags.writeable = False  # (handed out every step: the unit step keeps what it derives from it)

    def select(self, layer: int, x: np.ndarray, cached=None) -> np.ndarray:
        return self._all

    def select_inputs(self, layer: int, x: np.ndarray, cached=None) -> np.ndarray:
        return np.arange(x.shape[0], dtype=np.int32)

    def select_neurons(self, layer: int, glu: np.ndarray, cached=None) -> np.ndarray:
        return self._all


class Oracle:
    """Exact active sets from the true activations. On the neurons layout it keeps its own resident
    copy of fc1 or gate+up; on the dip layout (`resident=False`) it reads every input column and
    ranks the exact GLU the runtime computed."""

    name = "oracle"

    def __init__(self, fd, density: Optional[float] = None, resident: bool = True):
        self.ffn = fd.ffn if fd is not None else None  # None: ranks given activations only (calib.quality)
        self.density = density
        self.bias = {}
        self.arrays: List[Dict[str, mx.array]] = []
        for i in range(len(fd.layers) if resident else 0):
            names = ("gate", "up") if self.ffn["kind"] == "glu" else ("fc1",)
            a = fd.unpack_layer(i)
            keep = {k: v for k, v in a.items() if k.split(".")[0] in names}
            mx.eval(keep)
            self.arrays.append(keep)
        self.nbytes = sum(v.nbytes for a in self.arrays for v in a.values())

    def activations(self, layer: int, x: np.ndarray) -> np.ndarray:
        m, a = self.ffn["matrices"], self.arrays[layer]
        xm = mx.array(x)[None]
        if self.ffn["kind"] == "glu":
            act = ACTIVATIONS[self.ffn["activation"]]
            h = act(project(xm, a, "gate", m["gate"])) * project(xm, a, "up", m["up"])
        else:
            h = project(xm, a, "fc1", m["fc1"])
            if layer in self.bias:
                h = h + self.bias[layer]
            h = mx.maximum(h, 0)
        return np.array(h.astype(mx.float32))[0]

    def select(self, layer: int, x: np.ndarray, cached=None) -> np.ndarray:
        return self.select_neurons(layer, self.activations(layer, x))

    def select_inputs(self, layer: int, x: np.ndarray, cached=None) -> np.ndarray:
        return np.arange(x.shape[0], dtype=np.int32)

    def select_neurons(self, layer: int, glu: np.ndarray, cached=None) -> np.ndarray:
        return _ids(self.neuron_masks(layer, _rows(glu)))

    def neuron_masks(self, layer: int, glu: np.ndarray, cached=None) -> np.ndarray:
        """The neurons of each row of the exact activations: non-zero, or the top `density` of |h|."""
        h = np.abs(glu)
        return h != 0 if self.density is None else top_k_mask(h, round(self.density * h.shape[-1]))


class Predictor:
    """Low-rank predictor per layer: active = sigmoid(B (A x)) > threshold."""

    name = "predictor"

    def __init__(self, weights: List[Dict[str, mx.array]], threshold: float = 0.5, density: Optional[float] = None):
        self.weights = weights  # per layer {"A": [rank, d], "B": [n, rank]}
        self.nbytes = sum(v.nbytes for w in weights for v in w.values())  # DRAM held: in the budget
        self.threshold = threshold
        self.density = density  # set: the top-K logits per token instead of the threshold

    def logits(self, layer: int, x: np.ndarray) -> np.ndarray:
        """[T, d] rows -> [T, n] logits, row by row (see the module's note)."""
        w = self.weights[layer]
        return _by_row(x, lambda r: (r @ w["A"].T) @ w["B"].T)

    def select(self, layer: int, x: np.ndarray, cached=None) -> np.ndarray:
        return _ids(self.masks(layer, _rows(x)))

    def masks(self, layer: int, x: np.ndarray, cached=None) -> np.ndarray:
        z = self.logits(layer, x)
        if self.density is not None:
            return top_k_mask(z, round(self.density * z.shape[-1]))
        return z > np.log(self.threshold / (1 - self.threshold))  # sigmoid(z) > t  <=>  z > logit(t)


@dataclass
class DIP:
    """Dynamic Input Pruning; per-layer densities for gate/up inputs and down rows."""

    input_density: List[float]
    neuron_density: List[float]
    gamma: float = 1.0  # < 1: cache-aware (DIP-CA, the paper uses 0.2)
    name: str = field(default="dip", init=False)

    def select_inputs(self, layer: int, x: np.ndarray, cached: Optional[np.ndarray] = None) -> np.ndarray:
        return _ids(self.input_masks(layer, _rows(x), cached))

    def select_neurons(self, layer: int, glu: np.ndarray, cached: Optional[np.ndarray] = None) -> np.ndarray:
        return _ids(self.neuron_masks(layer, _rows(glu), cached))

    def input_masks(self, layer: int, x: np.ndarray, cached: Optional[np.ndarray] = None) -> np.ndarray:
        """[T, d] inputs -> bool [T, d]: the gate/up input columns each row keeps."""
        s = cache_aware_scores(np.abs(x), cached, self.gamma)
        return top_k_mask(s, round(self.input_density[layer] * x.shape[-1]))

    def neuron_masks(self, layer: int, glu: np.ndarray, cached: Optional[np.ndarray] = None) -> np.ndarray:
        """[T, n] GLU outputs of the pruned inputs -> bool [T, n]: the down rows each row keeps."""
        s = cache_aware_scores(np.abs(glu), cached, self.gamma)
        return top_k_mask(s, round(self.neuron_density[layer] * glu.shape[-1]))


class WINA(DIP):
    """Weight-aware DIP: |x_j| and |h_i| scaled by the norms of the weights they multiply
    (input j: ||[gate; up][:, j]||, neuron i: ||down[:, i]||), so a small input on heavy columns
    can outrank a large one on light columns."""

    def __init__(self, input_density, neuron_density, input_norm, neuron_norm, gamma: float = 1.0):
        super().__init__(input_density, neuron_density, gamma)
        self.name = "wina"
        self.input_norm, self.neuron_norm = input_norm, neuron_norm  # per layer [d], [n] float32
        self.nbytes = sum(v.nbytes for v in input_norm + neuron_norm)

    def input_masks(self, layer, x, cached=None):
        return super().input_masks(layer, x * self.input_norm[layer], cached)

    def neuron_masks(self, layer, glu, cached=None):
        return super().neuron_masks(layer, glu * self.neuron_norm[layer], cached)


class Sketch:
    """Top-K of the estimated |act(gate x) * (up x)| from resident low-bit copies of gate and up
    (`sketch_layer`); the runtime then reads the chosen neurons' exact rows."""

    name = "sketch"

    def __init__(
        self,
        layers: List[Dict[str, mx.array]],
        activation: str,
        bits: int,
        group_size: int,
        density: List[float],
        gamma: float = 1.0,
    ):
        self.layers, self.bits, self.group_size = layers, bits, group_size
        self.act = ACTIVATIONS[activation]
        self.density, self.gamma = list(density), gamma
        self.nbytes = sum(v.nbytes for a in layers for v in a.values())

    def estimate(self, layer: int, x: mx.array) -> mx.array:
        """|act(g~) * u~| for every neuron: x [..., d] -> [..., n]."""
        a = self.layers[layer]
        if "input_scale" in a:  # columns were scaled by s before quantising (selectors.build_sketch)
            x = x / a["input_scale"]

        def mm(name):
            return mx.quantized_matmul(
                x,
                a[f"{name}.weight"],
                a[f"{name}.scales"],
                a[f"{name}.biases"],
                transpose=True,
                group_size=self.group_size,
                bits=self.bits,
            )

        return mx.abs(self.act(mm("gate")) * mm("up"))

    def select(self, layer: int, x: np.ndarray, cached=None) -> np.ndarray:
        return _ids(self.masks(layer, _rows(x), cached))

    def masks(self, layer: int, x: np.ndarray, cached=None) -> np.ndarray:
        s = cache_aware_scores(_by_row(x, lambda r: self.estimate(layer, r)), cached, self.gamma)
        return top_k_mask(s, round(self.density[layer] * s.shape[-1]))


def sketch_layer(w: Dict[str, mx.array], bits: int, group_size: int) -> Dict[str, mx.array]:
    """Low-bit copies of one layer's gate and up ([n, d] float rows), quantised along d with float16
    scales and biases: what `Sketch` keeps resident."""
    out = {}
    for name in ("gate", "up"):
        q, s, b = mx.quantize(w[name].astype(mx.float16), group_size=group_size, bits=bits)
        out.update({f"{name}.weight": q, f"{name}.scales": s, f"{name}.biases": b})
    mx.eval(out)
    return out


def weight_norms(w: Dict[str, mx.array]):
    """WINA's column norms of one layer: ||[gate; up][:, j]|| [d] and ||down[:, i]|| [n] (float32 numpy)."""
    gu = mx.sqrt(mx.sum(w["gate"] ** 2, axis=0) + mx.sum(w["up"] ** 2, axis=0))
    down = mx.sqrt(mx.sum(w["down"] ** 2, axis=1))  # canonical down rows [n, d]: neuron i's output column
    return np.array(gu), np.array(down)
