"""Calibrated neuron selectors: build them from a model's weights, store them in a flash directory.

A flash directory records at most one calibrated selector, manifest["sparsity"]["selector"]:

    {"name": "sketch" | "wina" | "dip" | "predictor", "density": [per layer], "ppl_increase": 0.05,
     "file": "selector.safetensors" (if it keeps arrays), "nbytes": DRAM it keeps, ...}

`ppl_increase` is the held-out perplexity increase measured at calibration; `--sparsity auto`
uses the selector only if it is within what the user allows (loader.make_sparsifier).

The sketch (sparsity.Sketch) is a low-bit affine copy of each layer's gate and up. Before
quantising, input column j is scaled by s_j = mean|x_j|^alpha (AWQ's idea: the channels with large
inputs get finer steps) and x is divided by s at run time, so G~ (x / s) estimates G x. On SmolLM2,
alpha = 0.5 cuts the FFN output error of the sketch's top-50% from 2.0x to 1.8x the oracle's
(3 bits) and from 5.0x to 4.2x (2 bits).
"""

import os
from typing import Dict, List, Optional, Sequence

import mlx.core as mx
import numpy as np

from ..errors import FlashFormatError
from ..format.directory import FlashDir
from .sparsity import sketch_layer, weight_norms

SELECTOR_FILE = "selector.safetensors"


def build_sketch(
    weights: Sequence[Dict[str, mx.array]],
    xs: Optional[Sequence[np.ndarray]],
    bits: int,
    group_size: int = 64,
    alpha: float = 0.5,
) -> List[Dict[str, mx.array]]:
    """Per layer the quantised gate/up of the sketch and its input scale ("input_scale" [d] float32).
    xs: each layer's calibration FFN inputs [T, d] (None, or alpha 0: no scaling)."""
    out = []
    for i, w in enumerate(weights):
        d = w["gate"].shape[1]
        if xs is None or alpha == 0:
            s = mx.ones((d,), dtype=mx.float32)
        else:
            s = mx.power(mx.mean(mx.abs(mx.array(xs[i])), axis=0) + 1e-6, alpha)
            s = s / mx.sqrt(mx.max(s) * mx.min(s))  # centred on 1: keeps float16 scales in range
        a = sketch_layer({k: w[k] * s for k in ("gate", "up")}, bits, group_size)
        a["input_scale"] = s.astype(mx.float32)
        mx.eval(a)
        out.append(a)
    return out


def wina_norms(weights: Sequence[Dict[str, mx.array]]):
    """Per layer WINA's norms as (input_norm [d], neuron_norm [n]) lists of float32 numpy arrays."""
    pairs = [weight_norms(w) for w in weights]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def save_selector(fd: FlashDir, name: str, arrays: Optional[Sequence[Dict[str, mx.array]]] = None, **info) -> None:
    """Record `name` as the directory's selector (replacing any other), with its arrays in SELECTOR_FILE."""
    entry = {"name": name, **info}
    if arrays is not None:
        flat = {f"{i}.{k}": v for i, a in enumerate(arrays) for k, v in a.items()}
        tmp = fd.path / "selector.tmp.safetensors"
        mx.save_safetensors(str(tmp), flat)
        os.replace(tmp, fd.path / SELECTOR_FILE)
        entry["file"] = SELECTOR_FILE
        entry["nbytes"] = int(sum(v.nbytes for v in flat.values()))
    sparsity = dict(fd.manifest.get("sparsity") or {})
    sparsity["selector"] = entry
    fd.update_manifest(sparsity=sparsity)


def load_selector_arrays(fd: FlashDir) -> List[Dict[str, mx.array]]:

    entry = fd.manifest["sparsity"]["selector"]
    path = fd.path / entry["file"]
    if not path.is_file():
        raise FlashFormatError(f"{path}: missing file")
    flat = mx.load(str(path))
    out = [dict() for _ in fd.layers]
    for k, v in flat.items():
        i, name = k.split(".", 1)
        out[int(i)][name] = v
    return out
