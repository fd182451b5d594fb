"""Low-rank activation predictors: per layer sigmoid(B (A x)) trained to say which FFN neurons fire.

The targets are the true active sets recomputed from each layer's recorded inputs x (ReLU: h > 0;
SwiGLU: top-K of |GLU| at the target density). Each predictor is trained with Adam on a balanced loss
(positives and negatives weigh the same in total) on 90% of the tokens and measured on the rest; the
layers of lowest recall can be retrained at a higher rank. The threshold is given, or "auto": the
global threshold at which the predicted density over the training tokens equals the target.
"""

import math
from typing import List

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from tqdm import tqdm

from ..format.directory import FlashDir
from .quality import activation_targets, dense_ffn_weights


def balanced_loss(z: mx.array, y: mx.array, pos_rate: float) -> mx.array:
    """Binary cross entropy in which positives and negatives carry half of the weight each."""
    wp, wn = 0.5 / max(pos_rate, 1e-6), 0.5 / max(1 - pos_rate, 1e-6)
    softplus = mx.maximum(z, 0) + mx.log1p(mx.exp(-mx.abs(z)))  # log(1 + e^z); softplus(-z) = softplus(z) - z
    return mx.mean((wp * y + wn * (1 - y)) * softplus - wp * y * z)


def _balanced_grads(p, x, y, wp, wn):
    """Gradients of `balanced_loss` w.r.t. A and B, written out (MLX's CPU autodiff of softplus is ~4x slower)."""
    h = x @ p["A"].T
    z = h @ p["B"].T
    w = wp * y + wn * (1 - y)
    gz = (w * mx.sigmoid(z) - wp * y) / z.size
    return {"A": (gz @ p["B"]).T @ x, "B": gz.T @ h}


def train_predictor(
    x: np.ndarray,
    y: np.ndarray,
    rank: int,
    steps: int = 200,
    lr: float = 3e-3,
    batch: int = 256,
    seed: int = 0,
    log_every: int = 10,
):
    """Fit sigmoid(B (A x)) to the bool targets y [T, n] with Adam on the balanced loss.

    Returns ({"A": [rank, d], "B": [n, rank]}, losses): the minibatch loss every `log_every` steps."""
    T, d = x.shape
    n = y.shape[1]
    rng = np.random.default_rng(seed)
    params = {
        "A": mx.array(rng.normal(0, 1 / math.sqrt(d), (rank, d)).astype(np.float32)),
        "B": mx.array(rng.normal(0, 1 / math.sqrt(rank), (n, rank)).astype(np.float32)),
    }
    opt = optim.Adam(learning_rate=lr)
    opt.init(params)
    pos = float(y.mean())
    wp, wn = 0.5 / max(pos, 1e-6), 0.5 / max(1 - pos, 1e-6)
    X, Y = mx.array(x), mx.array(y.astype(np.float32))
    losses = []
    for s in range(steps):
        idx = mx.array(rng.integers(0, T, min(batch, T)))
        xb, yb = X[idx], Y[idx]
        if s % log_every == 0 or s == steps - 1:
            losses.append(float(balanced_loss((xb @ params["A"].T) @ params["B"].T, yb, pos).item()))
        params = opt.apply_gradients(_balanced_grads(params, xb, yb, wp, wn), params)
        mx.eval(params, opt.state)
    return params, losses


def _logits(p, x: np.ndarray) -> np.ndarray:
    return np.array((mx.array(x) @ p["A"].T) @ p["B"].T)


def recall_precision(z: np.ndarray, y: np.ndarray, t: float):
    pred = z > t
    tp = float((pred & y).sum())
    return tp / max(float(y.sum()), 1.0), tp / max(float(pred.sum()), 1.0), float(pred.mean())


def train_predictors(
    fd: FlashDir,
    xs: List[np.ndarray],
    density: float,
    rank: int = 64,
    rank_worst: int = 128,
    worst_layers: int = 2,
    threshold="auto",
    steps: int = 200,
    lr: float = 3e-3,
    progress: bool = False,
    weights=None,
) -> dict:
    """Train one predictor per layer on a 90/10 split of the tokens; returns weights, threshold, metrics."""
    kind, act = fd.ffn["kind"], fd.ffn["activation"]
    resident = fd.load_resident() if kind == "relu" else {}
    data = []
    for i, x in enumerate(xs):
        w = weights[i] if weights else dense_ffn_weights(fd, i)
        bias = resident.get(f"{fd.ffn['mlp_paths'][i]}.fc1.bias")
        y = activation_targets(x, w, kind, act, density, None if bias is None else bias.astype(mx.float32))
        cut = max(1, int(0.9 * len(x)))
        data.append((x[:cut], y[:cut], x[cut:], y[cut:]))
    preds, losses, ranks = [], [], []
    for i in tqdm(range(len(xs)), desc="predictors", unit="layer", disable=not progress):
        p, l = train_predictor(data[i][0], data[i][1], rank, steps, lr, seed=i)
        preds.append(p), losses.append(l), ranks.append(rank)

    def val_recall(i):
        return recall_precision(_logits(preds[i], data[i][2]), data[i][3], 0.0)[0]

    if worst_layers and rank_worst > rank:
        order = sorted(range(len(xs)), key=val_recall)[:worst_layers]
        for i in order:
            p, l = train_predictor(data[i][0], data[i][1], rank_worst, steps, lr, seed=i)
            preds[i], losses[i], ranks[i] = p, l, rank_worst
    if threshold == "auto":  # the predicted density over the training tokens equals `density`
        z = np.concatenate([_logits(preds[i], data[i][0]).ravel() for i in range(len(xs))])
        zt = float(np.quantile(z, 1 - density)) if kind == "glu" else 0.0
        threshold = float(1 / (1 + math.exp(-zt)))
    threshold = float(threshold)
    t = math.log(threshold / (1 - threshold))
    recall, precision, active = [], [], []
    for i in range(len(xs)):
        r, pr, a = recall_precision(_logits(preds[i], data[i][2]), data[i][3], t)
        recall.append(r), precision.append(pr), active.append(a)
    return {
        "weights": preds,
        "threshold": threshold,
        "ranks": ranks,
        "recall": recall,
        "precision": precision,
        "predicted_density": active,
        "target_density": density,
        "true_density": [float(d[3].mean()) for d in data],
        "loss_first": [l[0] for l in losses],
        "loss_last": [float(np.mean(l[-3:])) for l in losses],
    }
