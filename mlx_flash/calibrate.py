"""Calibrate a flash directory on real text: the neuron selector it ships, predictors, DIP densities,
neuron order, a quality report.

    python -m mlx_flash.calibrate [--model DIR] [--data FILE ...] [--density 0.5]
        [--selector auto|sketch|wina|dip|predictor|none] [--sketch-bits 2,3,4] [--max-ppl-increase 0.10]
        [--rank 64] [--dip-target 0.5] [--dip-per-layer] [--reorder] [--report OUT_DIR]

By default it only collects activations and calibrates the selector (mlx_flash.calib.selector): the
candidates for the directory's layout at MLP density --density, cheapest DRAM first, measured on
held-out text; the first within --max-ppl-increase (else the best) is recorded in the manifest with
its measured increase, and `--sparsity auto` uses it. Predictors and DIP densities (below) are
trained for --selector predictor, --report or --dip-per-layer.

1. Activations: every layers[i].mlp of a resident float32 model records its input x on the
   calibration text (default: the first half of the bundled WikiText-2 test split); the true
   activations are recomputed from x per layer (ReLU: h > 0; SwiGLU: top-K of |GLU| at --density).
2. Predictors (neurons layout; mlx_flash.calib.predictors): per layer sigmoid(B (A x)), trained with
   Adam on a balanced loss (positives and negatives weigh the same in total); the --worst-layers layers
   with the lowest recall are retrained at --rank-worst. Threshold: --threshold, or "auto" = the global
   threshold at which the predicted density over the calibration tokens equals --density.
   Saved with FlashDir.save_predictors (ranks, recall, precision per layer).
3. DIP (GLU models; mlx_flash.calib.dip): for --dip-target MLP density t = (2 d_in + d_out) / 3, a ratio
   search over d_in (d_out = 3t - 2 d_in) on calibration text picks the split with the lowest loss
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
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import mlx.core as mx
import numpy as np
from tqdm import tqdm

from .calib.dip import calibrate_dip, calibrate_dip_per_layer
from .calib.predictors import train_predictors
from .calib.quality import (
    activation_targets,
    collect_inputs,
    dense_ffn_weights,
    eval_model,
    layer_statistics,
    perplexity,
    unit_strides,
)
from .calib.reorder import neuron_order, reorder, reorder_group
from .calib.selector import SKETCH_BITS, calibrate_selector
from .default_model import model_dir
from .format.directory import FlashDir
from .loader import load_tokenizer
from .texts import read_text, token_batches
from .tools.plot import pyplot


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

    fd = FlashDir(model_dir(path))
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
        "| mode | target | realised MLP density | perplexity | vs dense | KiB/token selected "
        "| KiB/token missed (LFU) |",
        "|---|---|---|---|---|---|---|",
    ]
    dense = next(r["ppl"] for r in report["quality"]["rows"] if r["mode"] == "dense")
    for r in report["quality"]["rows"]:
        lines.append(
            f"| {r['mode']} | {r['target_density']:.0%} | {r['mlp_density']:.3f} | {r['ppl']:.2f} | "
            f"{(r['ppl'] / dense - 1) * 100:+.1f}% | {r['bytes_selected'] / 1024:.0f} | "
            f"{r['bytes_missed'] / 1024:.0f} |"
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
    fd = FlashDir(model_dir(args.model))
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
            f"{np.mean(r['neuron_density']):.3f} (means over layers), "
            f"realised MLP density {r['realised_mlp_density']:.3f}"
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
