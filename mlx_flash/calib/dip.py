"""DIP densities for GLU models: the split of an MLP density between input and neuron pruning.

DIP keeps the top d_in of each layer's input columns by |x| and the top d_out of its neurons by |GLU|;
its MLP density is t = (2 d_in + d_out) / 3. `calibrate_dip` searches the ratio: for a target t it tries
d_in over a range (d_out = 3 t - 2 d_in) and keeps the split of lowest calibration NLL, the same for
every layer. `calibrate_dip_per_layer` then gives each layer its own density at the same mean: each
layer's sensitivity around the uniform split, allocated by a knapsack DP (`allocate_densities`), kept
only if it beats the uniform split.
"""

from typing import List, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from tqdm import tqdm

from .quality import sequence_nll


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


def split_density(d: float, a: float, b: float):
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
       per-layer density keeps its d_in : d_out ratio (`split_density`).
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
            d_in, d_out = split_density(d, a, b)
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
    split = [split_density(d, a, b) for d in mlp]
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
