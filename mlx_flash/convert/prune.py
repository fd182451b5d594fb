"""Wanda pruning (Sun et al. 2023, "A Simple and Effective Pruning Approach for LLMs") of FFN matrices.

Wanda scores each weight of a linear layer y = W x (W [out, in]) by

    S_ij = |W_ij| * ||X_j||_2

where ||X_j||_2 is the L2 norm of input channel j over the calibration tokens, and removes
(sets to +0.0) the lowest-scoring weights of each output row, so every row keeps exactly
in - floor(sparsity * in) weights (ties broken by the lower index being pruned first).
With uniform norms this is magnitude pruning. No weight update, no retraining.

The inputs per FFN matrix: gate/up (fc1) see the FFN input x; down (fc2) sees the GLU
output h = act(gate x) * (up x) (ReLU models: act(fc1 x + b1)).

Pruned rows compress with mlx_flash.format.bitmap (ENDOR). A unit on flash holds neuron i's row of
gate/up ([n_ffn, d]: an output row, so `per="output"` gives every unit the same non-zero
count) and column i of down ([d, n_ffn]). Wanda's per-output groups for down are its rows,
so a neuron's down column gets a varying count and the bitmap capacity (the maximum) is
larger than (1 - sparsity) * d; `per="input"` prunes each column to the exact count instead
(within one column all weights share the same ||h_i||, so that is magnitude pruning of the
column). Measured on SmolLM2-135M (WikiText-2 norms, 50%): per="output" leaves some down
column with 529-569 of 576 weights, so the fixed-size bitmap rows are as large as dense
(ratio 0.99-1.06 for float16); per="input" gives 288 and the ratio 0.566.

Functions:
    wanda_scores(w, norms)                          -> float32 numpy [out, in]
    prune_wanda(w, norms, sparsity, per="output")   -> pruned w (same type and dtype)
    prune_magnitude(w, sparsity, per="output")      -> pruned w
    collect_input_norms(model, batches)             -> per layer {"x": [d], "h": [n_ffn]}
    text_input_norms(model, tokenizer, text_path)   -> the same, on the first half of a text
                                                       (default WikiText-2 test)
    wikitext_input_norms(path, n_seqs, seq_len)     -> the same, loading a model directory
    stored_row_pruner(norms, sparsity, col_matrix)  -> prune(name, rows) for
                                                       FFNAdapter.split (mlx_flash.convert --prune)
"""

from pathlib import Path
from typing import Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..compute.ffn import ACTIVATIONS, project
from ..loader import load_resident, load_tokenizer
from ..texts import read_text, token_batches
from .source import load_source_model


def _to_numpy_f32(a) -> np.ndarray:
    if isinstance(a, mx.array):
        return np.array(a.astype(mx.float32))
    return np.asarray(a, dtype=np.float32)


def wanda_scores(w, norms) -> np.ndarray:
    """|W_ij| * ||X_j||_2 for W [out, in] and input-channel norms [in], as float32 numpy."""
    w32 = _to_numpy_f32(w)
    norms = _to_numpy_f32(norms).reshape(-1)
    if w32.ndim != 2 or norms.shape[0] != w32.shape[1]:
        raise ValueError(f"weights {w32.shape} and norms {norms.shape}: expected [out, in] and [in]")
    return np.abs(w32) * norms[None, :]


def keep_mask(scores: np.ndarray, sparsity: float, per: str = "output") -> np.ndarray:
    """Boolean mask of the weights kept: in each row (per="output") or column (per="input")
    of `scores`, the floor(sparsity * length) lowest scores are dropped (stable: on ties the
    lower index goes first)."""
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity}")
    if per not in ("output", "input"):
        raise ValueError(f"per must be 'output' or 'input', got {per!r}")
    s = scores if per == "output" else scores.T
    n_prune = int(sparsity * s.shape[1])
    order = np.argsort(s, axis=1, kind="stable")[:, :n_prune]
    mask = np.ones(s.shape, bool)
    np.put_along_axis(mask, order, False, axis=1)
    return mask if per == "output" else mask.T


def _apply(w, mask: np.ndarray):
    if isinstance(w, mx.array):
        return mx.where(mx.array(mask), w, mx.zeros((), w.dtype))
    w = np.asarray(w)
    return np.where(mask, w, np.zeros((), w.dtype)).astype(w.dtype)


def prune_wanda(w, norms, sparsity: float, per: str = "output"):
    """W [out, in] with the lowest-scoring weights (|W_ij| * norms_j) set to +0.0 (see keep_mask).

    `w`: numpy or mx array (any float dtype; the result has the same type and dtype);
    `norms`: L2 norms of the input channels over calibration tokens [in].
    """
    return _apply(w, keep_mask(wanda_scores(w, norms), sparsity, per))


def prune_magnitude(w, sparsity: float, per: str = "output"):
    """Magnitude pruning: Wanda with every input norm equal."""
    return prune_wanda(w, np.ones(w.shape[1], np.float32), sparsity, per)


def stored_row_pruner(norms: Dict[str, np.ndarray], sparsity: float, col_matrix: str):
    """Wanda on the FFN rows as a flash bundle stores them (FFNAdapter.split's `prune`).

    gate/up (fc1) rows are output rows: per="output" with the x norms. A stored down (fc2)
    row is column i of W_down: per="input" with the h norms, so every unit keeps the same
    count and its bitmap rows have no slack (see the module docstring).
    """

    def prune(name, rows):
        if name == col_matrix:
            return prune_wanda(rows.T, norms["h"], sparsity, per="input").T
        return prune_wanda(rows, norms["x"], sparsity, per="output")

    return prune


def row_sparsity(w) -> np.ndarray:
    """Fraction of exact zeros (+0.0 or -0.0) in each row."""
    return (_to_numpy_f32(w) == 0).mean(axis=1)


# -- calibration norms ---------------------------------------------------------------------


class _Recorder(nn.Module):
    """Stands in for a layer's mlp: runs it and adds the squared inputs x and h to sums."""

    def __init__(self, mlp, sums: dict):
        super().__init__()
        self._mlp, self._sums = mlp, sums
        self._down = None
        ffn = getattr(mlp, "_ffn", None)
        if ffn is None:  # an mlx-lm MLP: record h at the input of its down projection
            for name in ("down_proj", "fc2", "w2"):
                if hasattr(mlp, name):
                    self._down = name
                    break
            else:
                raise ValueError(f"{type(mlp).__name__}: no down_proj / fc2 / w2 to record h at")

    def _add(self, key, a):
        a = a.astype(mx.float32).reshape(-1, a.shape[-1])
        sq = mx.sum(a * a, axis=0)
        self._sums[key] = sq if key not in self._sums else self._sums[key] + sq

    def __call__(self, x):
        self._add("x", x)
        mlp = self._mlp
        if self._down is None:  # mlx_flash.compute.ffn.ResidentFFN: h from the stored rows
            ffn, arrays, bias = mlp.parts
            bias = bias or {}
            m, act = ffn["matrices"], ACTIVATIONS[ffn["activation"]]
            if ffn["kind"] == "glu":
                h = act(project(x, arrays, "gate", m["gate"])) * project(x, arrays, "up", m["up"])
                y = project(h, arrays, "down", m["down"])
            else:
                h = project(x, arrays, "fc1", m["fc1"])
                h = act(h + bias["fc1"] if "fc1" in bias else h)
                y = project(h, arrays, "fc2", m["fc2"])
                if "fc2" in bias:
                    y = y + bias["fc2"]
            self._add("h", h)
            return y
        down = getattr(mlp, self._down)
        recorder = self

        class _Down(nn.Module):
            def __call__(self, h):
                recorder._add("h", h)
                return down(h)

        setattr(mlp, self._down, _Down())
        try:
            return mlp(x)
        finally:
            setattr(mlp, self._down, down)


def _layers(model):
    inner = getattr(model, "model", None)
    if hasattr(model, "layers"):
        return model.layers
    if inner is not None and hasattr(inner, "layers"):
        return inner.layers
    raise ValueError(f"{type(model).__name__} has no .layers")


def collect_input_norms(model, batches: np.ndarray, progress: bool = False) -> List[Dict[str, np.ndarray]]:
    """L2 norm over all calibration tokens of every FFN input channel, per layer.

    model: an mlx-lm model (mlx_flash.convert.source.load_source_model) or a resident flash model
    (mlx_flash.loader.load_resident(path)[0], whose mlps are ResidentFFN: then "h" is in the
    stored (possibly reordered) neuron order of the flash directory).
    batches: int token ids [n_seqs, seq_len] (one sequence per forward pass).
    Returns [{"x": [d] for gate/up (fc1), "h": [n_ffn] for down (fc2)}] float32 numpy.
    """
    layers = _layers(model)
    sums = [dict() for _ in layers]
    originals = [layer.mlp for layer in layers]
    try:
        for layer, s in zip(layers, sums):
            layer.mlp = _Recorder(layer.mlp, s)
        from tqdm import tqdm

        for row in tqdm(np.asarray(batches), desc="calibrate", unit="seq", disable=not progress):
            model(mx.array(np.asarray(row, np.int32)[None, :]))
            mx.eval([v for s in sums for v in s.values()])
    finally:
        for layer, mlp in zip(layers, originals):
            layer.mlp = mlp
    return [{k: np.sqrt(np.array(v)) for k, v in s.items()} for s in sums]


def wikitext_input_norms(path, n_seqs: int = 32, seq_len: int = 512, text_path: Optional[Path] = None):
    """collect_input_norms on the first half of WikiText-2 test (the calibration half).

    path: a flash directory (has flash.json: loaded with load_resident) or an mlx-lm
    model directory (load_source_model). Returns (norms per layer, model).
    """

    path = Path(path)
    if (path / "flash.json").is_file():
        model, fd = load_resident(path)
        tok = load_tokenizer(fd)
    else:
        from mlx_lm.utils import load_tokenizer as _load_tokenizer

        model, _ = load_source_model(path)
        tok = _load_tokenizer(path)
    return text_input_norms(model, tok, text_path, n_seqs, seq_len), model


def text_input_norms(
    model, tokenizer, text_path: Optional[Path] = None, n_seqs: int = 32, seq_len: int = 512, progress: bool = False
) -> List[Dict[str, np.ndarray]]:
    """collect_input_norms on up to n_seqs x seq_len tokens of the first half of `text_path`
    (default WikiText-2 test: its second half is where quality.py measures perplexity)."""

    text = read_text([text_path] if text_path else None, half="first")
    text = text[: 16 * n_seqs * (seq_len + 1)]  # enough for the tokens needed (>= 1 char per token), fast to encode
    batches = token_batches(tokenizer, text, seq_len, n_seqs)[:, :-1]
    return collect_input_norms(model, batches, progress)
