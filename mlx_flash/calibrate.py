"""Calibrate a flash directory on real text: the neuron selector it ships, predictors, DIP densities,
neuron order, a quality report.

    python -m mlx_flash.calibrate [--model DIR] [--data FILE ...] [--density 0.5]
        [--selector auto|sketch|wina|dip|predictor|none] [--sketch-bits 2,3,4] [--max-ppl-increase 0.10]
        [--rank 64] [--dip-target 0.5] [--dip-per-layer] [--reorder] [--report OUT_DIR]

By default it only collects activations and calibrates the selector (`calibrate_selector`): the
candidates for the directory's layout at MLP density --density, cheapest DRAM first, measured on
held-out text; the first within --max-ppl-increase (else the best) is recorded in the manifest with
its measured increase, and `--sparsity auto` uses it. Predictors and DIP densities (below) are
trained for --selector predictor, --report or --dip-per-layer.

1. Activations: every layers[i].mlp of a resident float32 model records its input x on the
   calibration text (default: the first half of the bundled WikiText-2 test split); the true
   activations are recomputed from x per layer (ReLU: h > 0; SwiGLU: top-K of |GLU| at --density).
2. Predictors (neurons layout): per layer sigmoid(B (A x)), trained with Adam on a balanced
   loss (positives and negatives weigh the same in total); the --worst-layers layers with the
   lowest recall are retrained at --rank-worst. Threshold: --threshold, or "auto" = the global
   threshold at which the predicted density over the calibration tokens equals --density.
   Saved with FlashDir.save_predictors (ranks, recall, precision per layer).
3. DIP (GLU models): for --dip-target MLP density t = (2 d_in + d_out) / 3, a ratio search over
   d_in (d_out = 3t - 2 d_in) on calibration text picks the split with the lowest loss
   (DIP appendix B.1); the same split for every layer. Recorded as manifest sparsity["dip"].
   --dip-per-layer: then per-layer densities at the same mean (calibrate_dip_per_layer: each layer's
   NLL change around the uniform split, allocated by a knapsack DP); kept only if its calibration NLL
   beats the uniform split's.
4. --reorder: rewrite ffn.bin so that hot, co-active neurons are adjacent (mlx_flash.calib.reorder).
5. --report OUT_DIR: per-layer recall/precision and active fractions (report.json, a png),
   perplexity on held-out text (default: the second half of the same file) for dense, oracle,
   predictor, DIP and DIP-CA at --densities, with the bytes per token each would read.
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from tqdm import tqdm

from .calib.quality import (
    activation_targets,
    collect_inputs,
    dense_ffn_weights,
    eval_model,
    layer_statistics,
    perplexity,
    sequence_nll,
    unit_strides,
)
from .calib.reorder import neuron_order, reorder, reorder_group
from .default_model import default_model_dir
from .engine.selectors import build_sketch, save_selector, wina_norms
from .engine.sparsity import Sketch
from .format.directory import FlashDir
from .loader import load_tokenizer
from .texts import read_text, token_batches
from .tools.plot import pyplot


# -- 1. activations ---------------------------------------------------------------------------
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


# -- 3. DIP -------------------------------------------------------------------------------------
def dip_candidates(target: float, count: int = 5) -> List[float]:
    """Input densities d_in with d_out = 3 t - 2 d_in inside [0.05, 1]."""
    if target >= 1:
        return [1.0]
    lo = max((3 * target - 1) / 2, 0.05)
    hi = min(1.0, (3 * target - 0.05) / 2)
    return sorted(set(round(float(v), 4) for v in np.linspace(lo, hi, count)))


def calibrate_dip(
    model, ctl, batches: np.ndarray, target: float, count: int = 5, progress: bool = False, mode: str = "dip", **kw
) -> dict:
    """Ratio search: for each split (d_in, 3t - 2 d_in), the calibration NLL; the best split for every layer.
    mode "wina" (with kw input_norm / neuron_norm) searches the split of weight-aware DIP."""
    L = ctl.n_layers
    results = []
    for d_in in tqdm(dip_candidates(target, count), desc=f"{mode} {target:.0%}", disable=not progress):
        d_out = min(1.0, max(0.0, 3 * target - 2 * d_in))
        ctl.set_mode(mode, input_density=[d_in] * L, neuron_density=[d_out] * L, **kw)
        nll = sequence_nll(model, ctl, batches)
        results.append(
            {
                "input_density": d_in,
                "neuron_density": d_out,
                "nll": nll,
                "realised_mlp_density": float(ctl.realised()["mlp"].mean()),
            }
        )
    best = min(results, key=lambda r: r["nll"])
    return {
        "input_density": [best["input_density"]] * L,
        "neuron_density": [best["neuron_density"]] * L,
        "target": target,
        "realised_mlp_density": best["realised_mlp_density"],
        "search": results,
    }


def _split(d: float, a: float, b: float):
    """(d_in, d_out) with MLP density (2 d_in + d_out) / 3 = d, in the ratio a : b of a split at density
    (2 a + b) / 3 = 1 (scaled), clipped to [0, 1] with the excess moved to the other side."""
    d = min(max(d, 0.0), 1.0)
    d_in, d_out = a * d, b * d
    if d_in > 1:
        d_in, d_out = 1.0, 3 * d - 2
    elif d_out > 1:
        d_in, d_out = (3 * d - 1) / 2, 1.0
    return float(d_in), float(min(max(d_out, 0.0), 1.0))


def allocate_densities(
    levels: Sequence[Sequence[float]], costs: Sequence[Sequence[float]], target: float, step: float = 0.025
) -> List[float]:
    """Per-layer MLP densities minimising the sum of per-layer costs (each piecewise linear over its
    levels) subject to mean density == target (on a grid of `step`; a multiple-choice knapsack, by DP)."""
    L = len(levels)
    grid = np.round(np.arange(0, 1 + 1e-9, step), 6)
    budget = int(round(L * target / step))
    INF = float("inf")
    best = np.full(budget + 1, INF)
    best[0] = 0.0
    choice = []
    for lv, c in zip(levels, costs):
        lv, c = np.asarray(lv, float), np.asarray(c, float)
        o = np.argsort(lv)
        lv, c = lv[o], c[o]
        pts = grid[(grid >= lv[0] - 1e-9) & (grid <= lv[-1] + 1e-9)]
        units = np.round(pts / step).astype(int)
        cost = np.interp(pts, lv, c)
        nxt = np.full(budget + 1, INF)
        arg = np.full(budget + 1, -1)
        for u, cu in zip(units, cost):
            if u > budget:
                continue
            cand = np.full(budget + 1, INF)
            cand[u:] = best[: budget + 1 - u] + cu
            better = cand < nxt
            nxt[better], arg[better] = cand[better], u
        best = nxt
        choice.append(arg)
    if not np.isfinite(best[budget]):
        raise ValueError(f"target {target} not reachable with levels {levels}")
    out, b = [], budget
    for arg in reversed(choice):
        u = int(arg[b])
        out.append(u * step)
        b -= u
    return [float(v) for v in reversed(out)]


def _logprobs(model, batches: np.ndarray) -> List[mx.array]:
    out = []
    for row in batches:
        lp = nn.log_softmax(model(mx.array(row[None, :-1])).astype(mx.float32), axis=-1)
        mx.eval(lp)
        out.append(lp)
    return out


def _kl_to(model, ref: List[mx.array], batches: np.ndarray) -> float:
    """Mean per-token KL(ref || model) over the batches (ref: log-probabilities of the dense model)."""
    total, count = 0.0, 0
    for lp_ref, row in zip(ref, batches):
        lp = nn.log_softmax(model(mx.array(row[None, :-1])).astype(mx.float32), axis=-1)
        total += float(mx.sum(mx.exp(lp_ref) * (lp_ref - lp)).item())
        count += row.shape[0] - 1
    return total / count


def calibrate_dip_per_layer(
    model,
    ctl,
    batches: np.ndarray,
    target: float,
    count: int = 5,
    offsets: Sequence[float] = (-0.2, -0.1, 0.0, 0.15, 0.3),
    sens_seqs: int = 1,
    sensitivity: str = "kl",
    step: float = 0.025,
    progress: bool = False,
) -> dict:
    """Per-layer DIP densities at mean MLP density `target`.

    1. The uniform ratio search (`calibrate_dip`) gives the split (d_in, d_out) at the target; every
       per-layer density keeps its d_in : d_out ratio (`_split`).
    2. Sensitivity of each layer l at MLP densities target + offsets (and 1.0), on the first `sens_seqs`
       calibration sequences, L x len(offsets) forward passes:
         "kl"  (default) every other layer dense; the KL divergence of the output from the dense model's.
         "nll" every other layer at the uniform split; the change of the NLL (noisy: on SmolLM2 single
               layers moved by +-0.05 nats in both directions, the sum did not predict the joint NLL).
       Costs are made non-increasing in density (a denser layer is never assumed to cost more).
    3. Allocation: minimise the summed costs (linear between measured densities) with the mean MLP
       density fixed at the target (`allocate_densities`).
    4. The allocation against the uniform split on all `batches` ("kl": KL to the dense model; "nll":
       the NLL, which on 2 x 256 tokens of SmolLM2 is too noisy to rank allocations); the uniform
       split is kept if the per-layer one is not better ("chosen")."""
    L = ctl.n_layers
    uni = calibrate_dip(model, ctl, batches, target, count, progress)
    if target >= 1:
        return dict(uni, per_layer={"chosen": "uniform", "mlp_density": [1.0] * L})
    a, b = uni["input_density"][0] / target, uni["neuron_density"][0] / target
    sens = batches[:sens_seqs]
    if sensitivity == "kl":
        ctl.set_mode("dense")
        ref = _logprobs(model, sens)
        other_in, other_out, base = [1.0] * L, [1.0] * L, 0.0
    elif sensitivity == "nll":
        other_in, other_out = list(uni["input_density"]), list(uni["neuron_density"])
        ctl.set_mode("dip", input_density=other_in, neuron_density=other_out)
        base = sequence_nll(model, ctl, sens)
    else:
        raise ValueError(f"unknown sensitivity {sensitivity!r} (kl or nll)")
    levels = sorted({round(min(1.0, max(0.05, target + o)), 4) for o in offsets} | {1.0})
    free = 1.0 if sensitivity == "kl" else target  # the cost known without a pass (0)
    levels = sorted(set(levels) | {free})
    costs = np.zeros((L, len(levels)))
    bar = tqdm(total=L * (len(levels) - 1), desc=f"dip per-layer {target:.0%} ({sensitivity})", disable=not progress)
    for l in range(L):
        for j, d in enumerate(levels):
            if d == free:
                continue
            d_in, d_out = _split(d, a, b)
            ctl.set_mode(
                "dip",
                input_density=other_in[:l] + [d_in] + other_in[l + 1 :],
                neuron_density=other_out[:l] + [d_out] + other_out[l + 1 :],
            )
            costs[l, j] = _kl_to(model, ref, sens) if sensitivity == "kl" else sequence_nll(model, ctl, sens) - base
            bar.update()
    bar.close()
    mono = np.maximum.accumulate(costs[:, ::-1], axis=1)[:, ::-1]  # non-increasing in density
    mlp = allocate_densities([levels] * L, mono, target, step)
    split = [_split(d, a, b) for d in mlp]
    d_in, d_out = [s[0] for s in split], [s[1] for s in split]
    ctl.set_mode("dip", input_density=d_in, neuron_density=d_out)
    nll = sequence_nll(model, ctl, batches)
    realised = float(ctl.realised()["mlp"].mean())
    uni_nll = min(r["nll"] for r in uni["search"])
    info = {
        "sensitivity_metric": sensitivity,
        "levels": levels,
        "sensitivity": costs.tolist(),
        "base": base,
        "mlp_density": mlp,
        "nll": nll,
        "uniform_nll": uni_nll,
        "realised_mlp_density": realised,
    }
    if sensitivity == "kl":  # decide on KL to dense over all batches: far less noisy than the NLL of 2 sequences
        ctl.set_mode("dense")
        ref = _logprobs(model, batches)
        ctl.set_mode("dip", input_density=d_in, neuron_density=d_out)
        info["kl"] = _kl_to(model, ref, batches)
        ctl.set_mode("dip", input_density=uni["input_density"], neuron_density=uni["neuron_density"])
        info["uniform_kl"] = _kl_to(model, ref, batches)
        better = info["kl"] <= info["uniform_kl"]
    else:
        better = nll <= uni_nll
    info["chosen"] = "per-layer" if better else "uniform"
    if not better:
        return dict(uni, per_layer=info)
    return {
        "input_density": d_in,
        "neuron_density": d_out,
        "target": target,
        "realised_mlp_density": realised,
        "search": uni["search"],
        "per_layer": info,
    }


# -- selector: the one the directory ships -----------------------------------------------------------
SKETCH_BITS = (2, 3, 4)  # tried cheapest first


def selector_candidates(
    layout: str, selector: str = "auto", group_size: int = 64, sketch_bits: Sequence[int] = SKETCH_BITS
) -> List[dict]:
    """The selectors calibration tries, cheapest DRAM first. auto: the sketches (of `sketch_bits`) on the
    neurons layout, DIP and WINA on the dip layout (the predictor only when asked: it is worse than a
    2-bit sketch of the same size on SmolLM2, BENCHMARKS.md)."""
    if selector == "auto":
        names = ["dip", "wina"] if layout == "dip" else ["sketch"]
    elif (selector in ("dip", "wina")) != (layout == "dip"):
        raise ValueError(
            f"--selector {selector} does not serve the {layout} layout (neurons: sketch, predictor; dip: dip, wina)"
        )
    else:
        names = [selector]
    out = []
    for name in names:
        if name == "sketch":
            out += [{"name": "sketch", "bits": b, "group_size": group_size} for b in sorted(sketch_bits)]
        else:
            out.append({"name": name})
    return out


def selector_setup(
    fd: FlashDir,
    model,
    ctl,
    cand: dict,
    density: float,
    weights,
    xs,
    calib: np.ndarray,
    dip_count: int = 5,
    predictor: Optional[dict] = None,
    progress: bool = False,
):
    """(Controller mode and kwargs, manifest info, arrays to save or None) for one candidate at `density`."""
    L = len(weights)
    name = cand["name"]
    if name == "sketch":
        bits, gs = cand["bits"], cand["group_size"]
        arrays = build_sketch(weights, xs, bits, gs)
        info = {"bits": bits, "group_size": gs, "density": [density] * L}
        return "sketch", {"sketch": Sketch(arrays, fd.ffn["activation"], bits, gs, info["density"])}, info, arrays
    if name in ("dip", "wina"):
        kw = {}
        if name == "wina":
            n_in, n_out = wina_norms(weights)
            kw = {"input_norm": n_in, "neuron_norm": n_out}
        split = calibrate_dip(model, ctl, calib, density, dip_count, progress, mode=name, **kw)
        info = {
            "input_density": split["input_density"],
            "neuron_density": split["neuron_density"],
            "density": [density] * L,
        }
        return name, dict(kw, input_density=info["input_density"], neuron_density=info["neuron_density"]), info, None
    if name == "predictor":
        info = {"density": [density] * L}
        return "predictor", {"predictors": predictor["weights"], "predictor_density": density}, info, None
    raise ValueError(f"unknown selector {name!r}")


def calibrate_selector(
    fd: FlashDir,
    model,
    ctl,
    calib: np.ndarray,
    held: np.ndarray,
    xs,
    weights,
    density: float = 0.5,
    selector: str = "auto",
    max_ppl_increase: float = 0.10,
    predictor: Optional[dict] = None,
    save: bool = True,
    progress: bool = False,
    sketch_bits: Sequence[int] = SKETCH_BITS,
) -> dict:
    """Measure the candidates at MLP density `density` on held-out text, cheapest DRAM first, and keep
    the first whose perplexity increase is within `max_ppl_increase` (else the best one measured).
    Saved as the directory's selector with the measured increase (`--sparsity auto` checks it)."""
    ctl.set_mode("dense")
    dense = perplexity(model, ctl, held)
    tried, best = [], None
    for cand in tqdm(
        selector_candidates(fd.ffn.get("layout", "neurons"), selector, sketch_bits=sketch_bits),
        desc="selector",
        disable=not progress,
    ):
        mode, kw, info, arrays = selector_setup(
            fd, model, ctl, cand, density, weights, xs, calib, predictor=predictor, progress=progress
        )
        ctl.set_mode(mode, **kw)
        ppl = perplexity(model, ctl, held)
        nbytes = int(sum(v.nbytes for a in arrays for v in a.values())) if arrays else _kw_nbytes(kw)
        row = dict(cand, ppl=ppl, dense_ppl=dense, ppl_increase=ppl / dense - 1, nbytes=nbytes)
        tried.append(row)
        if best is None or row["ppl_increase"] < best[0]["ppl_increase"]:
            best = (row, info, arrays)
        if row["ppl_increase"] <= max_ppl_increase:
            best = (row, info, arrays)
            break
    ctl.set_mode("dense")
    row, info, arrays = best
    entry = dict(
        info,
        ppl=row["ppl"],
        dense_ppl=dense,
        ppl_increase=row["ppl_increase"],
        held_out_tokens=int(held.shape[0] * (held.shape[1] - 1)),
    )
    if save:
        save_selector(fd, row["name"], arrays, **entry, **({} if arrays else {"nbytes": row["nbytes"]}))
    return {"name": row["name"], **entry, "nbytes": row["nbytes"], "tried": tried}


def _kw_nbytes(kw: dict) -> int:
    """Resident bytes of a candidate's arrays as the runtime keeps them (norms, predictors)."""
    n = 0
    for v in kw.values():
        if isinstance(v, list) and v and isinstance(v[0], (mx.array, np.ndarray)):
            n += sum(a.nbytes for a in v)
        elif isinstance(v, list) and v and isinstance(v[0], dict):
            n += sum(a.nbytes for d in v for a in d.values())
    return int(n)


# -- 5. report ------------------------------------------------------------------------------------
def bytes_per_token(fd: FlashDir, ctl, mode: str) -> Dict[str, float]:
    """Bytes a runtime would read per token: the selected units x their stride (no cache), and the
    LFU-cache misses x stride. On a neurons layout DIP's input pruning saves no I/O (a neuron's
    bundle holds its gate/up rows), so only its down selection counts there."""
    strides = unit_strides(fd)
    t = np.maximum(ctl.tokens, 1)
    dip_layout = "inputs" in strides
    sel = miss = 0.0
    for region, stride in strides.items():
        sel += float((ctl.selected[region] / t).sum()) * stride
        miss += float((ctl.missed[region] / t).sum()) * stride
    if dip_layout and mode not in ("dip", "dip-ca"):  # dense / oracle / predictor read every input column
        n_in = fd.layers[0]["inputs"].n_units
        sel += len(fd.layers) * n_in * strides["inputs"]
    return {"bytes_selected": sel, "bytes_missed": miss if mode != "dense" else sel}


def quality_report(
    fd: FlashDir,
    model,
    ctl,
    batches: np.ndarray,
    densities: Sequence[float],
    predictors=None,
    dip: Optional[Dict[float, dict]] = None,
    gamma: float = 0.2,
    cache_fraction: float = 0.5,
    progress: bool = False,
) -> dict:
    """Perplexity and bytes per token on `batches` for dense, oracle, predictor and DIP / DIP-CA."""
    runs = [("dense", 1.0, {})]
    glu = fd.ffn["kind"] == "glu"
    for d in densities:
        if glu:
            runs.append(("oracle", d, {"density": d}))
        if predictors and d in predictors:
            runs.append(
                ("predictor", d, {"predictors": predictors[d]["weights"], "threshold": predictors[d]["threshold"]})
            )
        if glu and dip and d in dip:
            kw = {"input_density": dip[d]["input_density"], "neuron_density": dip[d]["neuron_density"]}
            runs.append(("dip", d, kw))
            runs.append(("dip-ca", d, dict(kw, gamma=gamma)))
    rows = []
    for mode, d, kw in tqdm(runs, desc="report", disable=not progress):
        ctl.set_mode(mode, count_misses=True, cache_fraction=cache_fraction, **kw)
        t0 = time.perf_counter()
        ppl = perplexity(model, ctl, batches)
        r = ctl.realised()
        rows.append(
            {
                "mode": mode,
                "target_density": d,
                "ppl": ppl,
                "mlp_density": float(r["mlp"].mean()),
                "per_layer_mlp_density": r["mlp"].tolist(),
                **bytes_per_token(fd, ctl, mode),
                "seconds": time.perf_counter() - t0,
            }
        )
    ctl.set_mode("dense", count_misses=False)
    return {
        "rows": rows,
        "tokens": int(batches.shape[0] * (batches.shape[1] - 1)),
        "gamma": gamma,
        "cache_fraction": cache_fraction,
    }


def density_sweep(
    path=None,
    data: Sequence = None,
    densities: Sequence[float] = (0.75, 0.5),
    seq_len: int = 128,
    calib_seqs: int = 2,
    eval_seqs: int = 2,
    dip_candidates: int = 3,
    gamma: float = 0.2,
    progress: bool = False,
) -> dict:
    """DIP calibrated on the first half of `data`, then perplexity on the second half for dense, oracle,
    DIP and DIP-CA at each MLP density: the report's numbers, with nothing written to the directory.

    Returns {"model", "dip": {density: split and search}, "quality": quality_report(...)}."""

    fd = FlashDir(path if path is not None else default_model_dir())
    tok = load_tokenizer(fd)
    model, ctl = eval_model(fd)
    chars = 16 * (seq_len + 1) * max(calib_seqs, eval_seqs)  # tokenize only what is used (~4 chars a token)
    calib = token_batches(tok, read_text(data, "first")[:chars], seq_len, calib_seqs)
    held = token_batches(tok, read_text(data, "second")[:chars], seq_len, eval_seqs)
    densities = [d for d in densities if d < 1]  # dense is always the first row
    dip = {d: calibrate_dip(model, ctl, calib, d, dip_candidates, progress) for d in densities}
    return {
        "model": str(fd.path),
        "dip": dip,
        "quality": quality_report(fd, model, ctl, held, densities, None, dip, gamma, progress=progress),
    }


def plot_report(report: dict, path: Path, title: str = "") -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    ax = axes[0]
    for row in report["quality"]["rows"]:
        if row["mode"] != "dense" and abs(row["target_density"] - 0.5) < 1e-9:
            ax.plot(row["per_layer_mlp_density"], marker=".", label=f"{row['mode']} @50%")
    pred = report.get("predictor")
    if pred:
        ax.plot(pred["recall"], "k--", label="predictor recall")
        ax.plot(pred["precision"], "k:", label="predictor precision")
        ax.plot(pred["true_density"], color="grey", lw=0.8, label="true active fraction")
    ax.set_xlabel("layer"), ax.set_ylabel("fraction"), ax.set_ylim(0, 1.05), ax.legend(fontsize=7)
    ax.set_title("active fraction per layer (50% target), predictor recall/precision")
    ax = axes[1]
    dense = next(r["ppl"] for r in report["quality"]["rows"] if r["mode"] == "dense")
    for mode in ("oracle", "predictor", "dip", "dip-ca"):
        pts = sorted((r["mlp_density"], r["ppl"]) for r in report["quality"]["rows"] if r["mode"] == mode)
        if pts:
            ax.plot(*zip(*pts), marker="o", label=mode)
    ax.axhline(dense, color="k", lw=0.8, label="dense")
    ax.set_xlabel("MLP density (realised)"), ax.set_ylabel("perplexity (held-out)"), ax.set_yscale("log")
    ax.legend(fontsize=8), ax.set_title("perplexity vs MLP density")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_table(report: dict) -> str:
    lines = [
        "| mode | target | realised MLP density | perplexity | vs dense | KiB/token selected | KiB/token missed (LFU) |",
        "|---|---|---|---|---|---|---|",
    ]
    dense = next(r["ppl"] for r in report["quality"]["rows"] if r["mode"] == "dense")
    for r in report["quality"]["rows"]:
        lines.append(
            f"| {r['mode']} | {r['target_density']:.0%} | {r['mlp_density']:.3f} | {r['ppl']:.2f} | "
            f"{(r['ppl'] / dense - 1) * 100:+.1f}% | {r['bytes_selected'] / 1024:.0f} | {r['bytes_missed'] / 1024:.0f} |"
        )
    return "\n".join(lines)


# -- CLI ---------------------------------------------------------------------------------------------
def _floats(s: str) -> List[float]:
    return [float(v) / (100 if float(v) > 1 else 1) for v in s.split(",") if v]


def setup_arg_parser():
    p = argparse.ArgumentParser(
        description="Calibrate a flash directory: predictors, DIP densities, neuron order, report."
    )
    p.add_argument("--model", default=None, help="Flash directory (default: the converted SmolLM2). Modified in place.")
    p.add_argument(
        "--data", nargs="+", default=None, help="Calibration text file(s) (default: the bundled WikiText-2 test split)."
    )
    p.add_argument(
        "--data-half", choices=["first", "second", "all"], default="first", help="Part of each --data file used."
    )
    p.add_argument("--eval-data", nargs="+", default=None, help="Held-out text for --report (default: --data).")
    p.add_argument(
        "--eval-half",
        choices=["first", "second", "all"],
        default="second",
        help="Part of each --eval-data file (default second: never overlaps a first-half calibration).",
    )
    p.add_argument("--seq-len", type=int, default=256, help="Tokens per sequence.")
    p.add_argument("--num-seqs", type=int, default=8, help="Calibration sequences (activations for predictors).")
    p.add_argument("--dip-seqs", type=int, default=2, help="Calibration sequences for the DIP ratio search.")
    p.add_argument("--eval-seqs", type=int, default=4, help="Held-out sequences for --report.")
    p.add_argument(
        "--density", type=float, default=0.5, help="SwiGLU predictor target: top-K of |GLU| at this density."
    )
    p.add_argument("--rank", type=int, default=64, help="Predictor rank.")
    p.add_argument("--rank-worst", type=int, default=128, help="Rank for the --worst-layers layers of lowest recall.")
    p.add_argument("--worst-layers", type=int, default=2)
    p.add_argument(
        "--threshold", default="auto", help='Predictor threshold, or "auto" (predicted density = --density).'
    )
    p.add_argument("--steps", type=int, default=200, help="Adam steps per predictor.")
    p.add_argument("--learning-rate", type=float, default=3e-3)
    p.add_argument("--dip-target", type=float, default=0.5, help="DIP target MLP density recorded in the manifest.")
    p.add_argument("--dip-candidates", type=int, default=5, help="Splits tried by the DIP ratio search.")
    p.add_argument(
        "--dip-per-layer",
        action="store_true",
        help="Per-layer DIP densities (sensitivity around the uniform split, then an allocation at the "
        "same mean MLP density; L x 5 extra forward passes per target).",
    )
    p.add_argument(
        "--dip-sensitivity",
        choices=["kl", "nll"],
        default="kl",
        help="--dip-per-layer: KL to the dense model with the other layers dense (default), or the NLL "
        "change with the other layers at the uniform split.",
    )
    p.add_argument(
        "--selector",
        choices=["auto", "sketch", "wina", "dip", "predictor", "none"],
        default="auto",
        help="The selector the directory ships (manifest sparsity.selector, used by --sparsity auto). "
        "auto: the cheapest sketch (2/3/4-bit gate/up) within --max-ppl-increase on the neurons "
        "layout, DIP or WINA on the dip layout.",
    )
    p.add_argument(
        "--max-ppl-increase",
        type=float,
        default=0.10,
        help="Largest held-out perplexity increase a selector may cost (0.10 = +10%%).",
    )
    p.add_argument("--selector-seqs", type=int, default=2, help="Held-out sequences that measure the selector.")
    p.add_argument(
        "--sketch-bits",
        type=lambda s: [int(b) for b in s.split(",")],
        default=list(SKETCH_BITS),
        help="Sketch widths tried, e.g. 4 or 3,4 (default 2,3,4).",
    )
    p.add_argument("--no-predictor", action="store_true")
    p.add_argument("--no-dip", action="store_true")
    p.add_argument("--reorder", action="store_true", help="Rewrite ffn.bin with hot, co-active neurons adjacent.")
    p.add_argument("--report", default=None, help="Write report.json, report.md and report.png here.")
    p.add_argument(
        "--densities", type=_floats, default=[1.0, 0.75, 0.5, 0.3], help="Report densities, e.g. 100,75,50,30."
    )
    p.add_argument("--gamma", type=float, default=0.2, help="DIP-CA gamma.")
    p.add_argument(
        "--cache-fraction", type=float, default=0.5, help="Report: LFU cache size as a share of each layer's units."
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="No progress bars.")
    return p


def run(args) -> dict:

    progress = not args.quiet
    fd = FlashDir(args.model if args.model else default_model_dir())
    glu, layout = fd.ffn["kind"] == "glu", fd.ffn.get("layout", "neurons")
    tok = load_tokenizer(fd)
    calib = token_batches(tok, read_text(args.data, args.data_half), args.seq_len, args.num_seqs)
    model, ctl = eval_model(fd)
    t0 = time.perf_counter()
    xs = collect_inputs(model, ctl, calib, progress)
    weights = [dense_ffn_weights(fd, i) for i in range(len(fd.layers))]
    resident = fd.load_resident() if not glu else {}
    stats = []
    for i, x in enumerate(xs):
        b = resident.get(f"{fd.ffn['mlp_paths'][i]}.fc1.bias")
        s = layer_statistics(
            x,
            weights[i],
            fd.ffn["kind"],
            fd.ffn["activation"],
            args.density,
            None if b is None else b.astype(mx.float32),
        )
        stats.append(s)
    out = {
        "model": str(fd.path),
        "calibration_tokens": int(sum(len(x) for x in xs[:1])),
        "layer_stats": [{k: v for k, v in s.items() if k != "freq"} for s in stats],
    }
    sparsity = dict(fd.manifest.get("sparsity") or {})

    # 2. predictors (the neurons layout serves them; the report uses them on any layout)
    want_densities = sorted(set(args.densities) | {args.density}) if args.report else [args.density]
    predictors = {}
    if not args.no_predictor and (args.selector == "predictor" or args.report):
        for d in want_densities:
            if d >= 1:
                continue
            predictors[d] = train_predictors(
                fd,
                xs,
                d,
                args.rank,
                args.rank_worst,
                args.worst_layers,
                args.threshold if d == args.density else "auto",
                args.steps,
                args.learning_rate,
                progress,
                weights,
            )
        main_p = predictors[args.density]
        out["predictor"] = {k: v for k, v in main_p.items() if k != "weights"}
        if layout == "neurons":
            fd.save_predictors(
                main_p["weights"],
                main_p["threshold"],
                ranks=main_p["ranks"],
                recall=main_p["recall"],
                precision=main_p["precision"],
                target_density=args.density,
                predicted_density=main_p["predicted_density"],
            )
            sparsity = dict(fd.manifest["sparsity"])

    # 3. DIP
    dip = {}
    if glu and not args.no_dip and (args.report or args.dip_per_layer):
        dip_batches = calib[: args.dip_seqs]
        for d in sorted(set(want_densities if args.report else []) | {args.dip_target}):
            if args.dip_per_layer:
                dip[d] = calibrate_dip_per_layer(
                    model, ctl, dip_batches, d, args.dip_candidates, sensitivity=args.dip_sensitivity, progress=progress
                )
            else:
                dip[d] = calibrate_dip(model, ctl, dip_batches, d, args.dip_candidates, progress)
        sparsity["dip"] = dip[args.dip_target]
        fd.update_manifest(sparsity=sparsity)
        out["dip"] = {str(k): v for k, v in dip.items()}
    out["calibration_seconds"] = time.perf_counter() - t0

    # 4. neuron order
    if args.reorder:
        group = reorder_group(fd)
        perm = [
            neuron_order(activation_targets(x, w, fd.ffn["kind"], fd.ffn["activation"], args.density), group)
            for x, w in zip(xs, weights)
        ]
        reorder(fd.path, perm, progress=progress)
        fd = FlashDir(fd.path)
        for p in predictors.values():  # keep the in-memory predictors in the new order for the report
            p["weights"] = [{"A": w["A"], "B": w["B"][mx.array(pm)]} for w, pm in zip(p["weights"], perm)]
        out["reordered"] = True
        model, ctl = eval_model(fd)  # the weights moved: the selector and report see the new order
        weights = [dense_ffn_weights(fd, i) for i in range(len(fd.layers))]

    # the selector the directory ships (measured on held-out text; --sparsity auto checks the increase)
    if glu and args.selector != "none":
        held = token_batches(
            tok, read_text(args.eval_data or args.data, args.eval_half), args.seq_len, args.selector_seqs
        )
        out["selector"] = calibrate_selector(
            fd,
            model,
            ctl,
            calib[: args.dip_seqs],
            held,
            xs,
            weights,
            args.density,
            args.selector,
            args.max_ppl_increase,
            predictors.get(args.density),
            progress=progress,
            sketch_bits=args.sketch_bits,
        )
        fd = FlashDir(fd.path)

    # 5. report
    if args.report:
        report_dir = Path(args.report)
        report_dir.mkdir(parents=True, exist_ok=True)
        held = token_batches(tok, read_text(args.eval_data or args.data, args.eval_half), args.seq_len, args.eval_seqs)
        out["quality"] = quality_report(
            fd, model, ctl, held, args.densities, predictors, dip, args.gamma, args.cache_fraction, progress
        )
        with open(report_dir / "report.json", "w") as f:
            json.dump(out, f, indent=1)
        (report_dir / "report.md").write_text(format_table(out) + "\n")
        try:
            plot_report(out, report_dir / "report.png", f"{fd.path.name}: {out['quality']['tokens']} held-out tokens")
        except ImportError:
            print("matplotlib is not installed: no report.png (pip install matplotlib)", file=sys.stderr)
    return out


def main():
    args = setup_arg_parser().parse_args()
    try:
        out = run(args)
    except ValueError as e:  # e.g. a selector the layout cannot serve
        raise SystemExit(f"error: {e}")
    p = out.get("predictor")
    if p:
        print(
            f"predictors: threshold {p['threshold']:.3f}, mean recall {np.mean(p['recall']):.3f}, "
            f"precision {np.mean(p['precision']):.3f}, predicted density {np.mean(p['predicted_density']):.3f}"
        )
    for d, r in (out.get("dip") or {}).items():
        pl = r.get("per_layer")
        how = f" ({pl['chosen']} allocation)" if pl else ""
        print(
            f"dip {float(d):.0%}{how}: input density {np.mean(r['input_density']):.3f}, neuron density "
            f"{np.mean(r['neuron_density']):.3f} (means over layers), realised MLP density {r['realised_mlp_density']:.3f}"
        )
        if pl:
            print("  per-layer MLP density: " + " ".join(f"{v:.2f}" for v in pl["mlp_density"]))
    sel = out.get("selector")
    if sel:
        cfg = f" {sel['bits']}-bit" if "bits" in sel else ""
        print(
            f"selector: {sel['name']}{cfg} at MLP density {np.mean(sel['density']):.2f}: perplexity "
            f"{sel['ppl']:.2f} vs dense {sel['dense_ppl']:.2f} ({sel['ppl_increase']:+.1%}), "
            f"DRAM {sel['nbytes'] / 2**20:.1f} MiB"
        )
    if "quality" in out:
        print(format_table(out))


if __name__ == "__main__":
    main()
