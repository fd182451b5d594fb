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

A sparsifier sees the FFN input of one token (x [d], float32 numpy) and returns
sorted unit ids (int32). DIP needs the gate/up result to choose down rows, so
FlashMLP drives it in two steps (`select_inputs`, `select_neurons`).
"""

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import mlx.core as mx
import numpy as np

from .ffn import ACTIVATIONS, project
from .neuron_cache import cache_aware_scores

SPARSITIES = ("dense", "oracle", "predictor", "dip")


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest scores, sorted by index (int32)."""
    n = scores.shape[0]
    k = max(0, min(int(k), n))
    if k == n:
        return np.arange(n, dtype=np.int32)
    if k == 0:
        return np.zeros(0, dtype=np.int32)
    return np.sort(np.argpartition(-scores, k - 1)[:k]).astype(np.int32)


class Dense:
    name = "dense"

    def __init__(self, n_units: int):
        self.n = n_units
        self._all = np.arange(n_units, dtype=np.int32)

    def select(self, layer: int, x: np.ndarray, cached=None) -> np.ndarray:
        return self._all


class Oracle:
    """Exact active sets from the true activations (its own resident copy of fc1 or gate+up)."""

    name = "oracle"

    def __init__(self, fd, density: Optional[float] = None):
        self.ffn = fd.ffn
        self.density = density
        self.bias = {}
        names = ("gate", "up") if self.ffn["kind"] == "glu" else ("fc1",)
        self.arrays: List[Dict[str, mx.array]] = []
        for i in range(len(fd.layers)):
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
        h = np.abs(self.activations(layer, x))
        if self.density is None:
            return np.flatnonzero(h).astype(np.int32)
        return top_k(h, round(self.density * h.shape[0]))


class Predictor:
    """Low-rank predictor per layer: active = sigmoid(B (A x)) > threshold."""

    name = "predictor"

    def __init__(self, weights: List[Dict[str, mx.array]], threshold: float = 0.5):
        self.weights = weights  # per layer {"A": [rank, d], "B": [n, rank]}
        self.nbytes = sum(v.nbytes for w in weights for v in w.values())  # DRAM held: in the budget
        self.threshold = threshold

    def logits(self, layer: int, x: np.ndarray) -> np.ndarray:
        w = self.weights[layer]
        z = (mx.array(x)[None] @ w["A"].T) @ w["B"].T
        return np.array(z.astype(mx.float32))[0]

    def select(self, layer: int, x: np.ndarray, cached=None) -> np.ndarray:
        # sigmoid(z) > t  <=>  z > logit(t)
        t = np.log(self.threshold / (1 - self.threshold))
        return np.flatnonzero(self.logits(layer, x) > t).astype(np.int32)


@dataclass
class DIP:
    """Dynamic Input Pruning; per-layer densities for gate/up inputs and down rows."""

    input_density: List[float]
    neuron_density: List[float]
    gamma: float = 1.0  # < 1: cache-aware (DIP-CA, the paper uses 0.2)
    name: str = field(default="dip", init=False)

    def select_inputs(self, layer: int, x: np.ndarray, cached: Optional[np.ndarray] = None) -> np.ndarray:
        s = cache_aware_scores(np.abs(x), cached, self.gamma)
        return top_k(s, round(self.input_density[layer] * x.shape[0]))

    def select_neurons(self, layer: int, glu: np.ndarray, cached: Optional[np.ndarray] = None) -> np.ndarray:
        s = cache_aware_scores(np.abs(glu), cached, self.gamma)
        return top_k(s, round(self.neuron_density[layer] * glu.shape[0]))
