"""Choosing the neuron selector a flash directory ships: candidates measured on held-out text.

The candidates for the directory's layout (sketches of a few bit widths on the neurons layout, DIP and
WINA on the dip layout, the predictor when asked) are tried at one MLP density, cheapest DRAM first;
the first whose perplexity increase over dense stays within a bound (else the best one measured) is
saved in the directory with its measured increase, which `--sparsity auto` checks.
"""

from typing import List, Optional, Sequence

import mlx.core as mx
import numpy as np
from tqdm import tqdm

from ..engine.selectors import build_sketch, save_selector, wina_norms
from ..engine.sparsity import Sketch
from ..format.directory import FlashDir
from .dip import calibrate_dip
from .quality import perplexity

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
