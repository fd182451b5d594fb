"""Neuron selectors on one frontier: perplexity increase vs bytes read per token, with their DRAM.

    python benchmarks/selector_frontier.py [--model DIR] [--dip-model DIR] [--densities 0.75,0.5,0.3]
        [--eval-seqs 3] [--out benchmarks/results/selectors_smollm2.json]

(Not named selectors.py: a script's directory comes first on sys.path, and the stdlib has a selectors module.)

Every selector runs in quality.py's masked evaluation on the same resident float32 model (the
neurons-layout directory's weights), at each MLP density:

    oracle     top-K of the true |GLU| (reference: not deployable, it keeps gate+up resident)
    dip        top-K |x| inputs, top-K pruned |GLU| neurons; the split from a ratio search
    wina       DIP with weight-norm-scaled scores, its own ratio search
    sketch-Nb  top-K of |act(G~ x) U~ x| from N-bit (group 64, AWQ-scaled) copies of gate and up
    predictor  (--predictor) low-rank predictor trained on top-K |GLU|, top-K of its logits

Per row: held-out perplexity (second half of WikiText-2 test, windows starting with BOS; calibration
on the first half), greedy-token agreement with dense (the dense model's greedy continuations of
--prompts, then each selector teacher-forced on them: the share of positions whose argmax matches),
the DRAM the selector keeps, and bytes per token: the selected units x their flash stride, and the
misses of a per-layer LFU cache simulated token by token. All selectors get the same DRAM
(--cache-fraction of the FFN bytes): a selector's own bytes come out of its cache. dip / wina are
counted on the dip layout (input columns and down rows, strides from --dip-model), the others on
the neurons layout (whole bundles).
"""

import argparse
import json
import sys
import time
from pathlib import Path

# this file's name would shadow the standard library's `selectors` (subprocess imports it): the repo
# root replaces the script's directory on the path
sys.path[0] = str(Path(__file__).resolve().parents[1])

import mlx_flash  # noqa: E402,F401  (OpenBLAS before mlx.core)
from mlx_flash.calib.dip import calibrate_dip  # noqa: E402
from mlx_flash.calib.predictors import train_predictors  # noqa: E402
from mlx_flash.calib.quality import collect_inputs, dense_ffn_weights, eval_model, perplexity, unit_strides  # noqa: E402
from mlx_flash.default_model import default_model_dir  # noqa: E402
from mlx_flash.engine.selectors import build_sketch, wina_norms  # noqa: E402
from mlx_flash.engine.sparsity import (
    Oracle,  # noqa: E402
    Sketch,  # noqa: E402
)
from mlx_flash.format.directory import FlashDir  # noqa: E402
from mlx_flash.loader import load_tokenizer  # noqa: E402
from mlx_flash.texts import read_text, token_batches  # noqa: E402
from mlx_flash.tools.bench_io import machine_info  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from tqdm import tqdm  # noqa: E402

PROMPTS = [
    "The history of the Roman Empire",
    "To make a good cup of tea, you",
    "def fibonacci(n):",
    "The capital of France is",
]


def dense_continuations(model, ctl, tok, prompts, n):
    """Greedy continuations of each prompt by the dense model (KV-cached): lists of prompt + n tokens."""
    ctl.set_mode("dense")
    out = []
    for p in prompts:
        ids = list(tok.encode(p, add_special_tokens=False))
        bos = getattr(tok, "bos_token_id", None)
        ids = ([bos] if bos is not None else []) + ids
        cache = make_prompt_cache(model)
        logits = model(mx.array(ids)[None], cache=cache)
        seq = list(ids)
        for _ in range(n):
            t = int(mx.argmax(logits[0, -1]).item())
            seq.append(t)
            logits = model(mx.array([[t]]), cache=cache)
        out.append((len(ids), seq))
    return out


def agreement(model, conts) -> float:
    """Share of continuation positions whose argmax equals the dense greedy token (teacher-forced)."""
    hit = total = 0
    for n_prompt, seq in conts:
        logits = model(mx.array(seq[:-1])[None])
        pred = np.array(mx.argmax(logits[0, n_prompt - 1 :], axis=-1))
        hit += int((pred == np.array(seq[n_prompt:])).sum())
        total += len(seq) - n_prompt
    return hit / total


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="Neurons-layout flash directory (default: the converted SmolLM2).")
    p.add_argument(
        "--dip-model", default=None, help="The same model converted with --layout dip (strides for dip/wina)."
    )
    p.add_argument("--densities", default="0.75,0.5,0.3")
    p.add_argument("--sketch-bits", default="2,3,4")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--calib-seqs", type=int, default=4, help="First-half sequences: sketch input scales, predictors.")
    p.add_argument("--dip-seqs", type=int, default=1, help="Calibration sequences for the dip / wina ratio search.")
    p.add_argument("--dip-candidates", type=int, default=3)
    p.add_argument("--eval-seqs", type=int, default=3)
    p.add_argument("--gen-tokens", type=int, default=24)
    p.add_argument(
        "--cache-fraction", type=float, default=0.5, help="DRAM for cache + selector, as a share of the FFN bytes."
    )
    p.add_argument("--predictor", action="store_true", help="Also train and measure the low-rank predictor (top-K).")
    p.add_argument("--only", default=None, help="Comma-separated selector names to run (default: all).")
    p.add_argument("--out", default="benchmarks/results/selectors_smollm2.json")
    p.add_argument("--append", action="store_true", help="Keep --out's rows of the selectors not run now.")
    args = p.parse_args()

    fd = FlashDir(args.model or default_model_dir())
    tok = load_tokenizer(fd)
    model, ctl = eval_model(fd)
    L = ctl.n_layers
    calib = token_batches(tok, read_text(half="first"), args.seq_len, args.calib_seqs)
    held = token_batches(tok, read_text(half="second"), args.seq_len, args.eval_seqs)
    weights = [dense_ffn_weights(fd, i) for i in range(L)]
    xs = collect_inputs(model, ctl, calib, progress=True)
    conts = dense_continuations(model, ctl, tok, PROMPTS, args.gen_tokens)

    strides = {"neurons": unit_strides(fd)}
    ffn_bytes = {"neurons": fd.ffn_bytes}
    if args.dip_model:
        dfd = FlashDir(args.dip_model)
        strides["dip"], ffn_bytes["dip"] = unit_strides(dfd), dfd.ffn_bytes
    n_in, n_out = wina_norms(weights)
    norms = {"input_norm": n_in, "neuron_norm": n_out}

    def run(name, mode, target, nbytes, layout="neurons", **kw):
        cache_bytes = args.cache_fraction * ffn_bytes[layout] - nbytes
        ctl.set_mode(mode, count_misses=True, cache_fraction=max(cache_bytes, 0) / ffn_bytes[layout], **kw)
        t0 = time.perf_counter()
        ppl = perplexity(model, ctl, held)
        t = np.maximum(ctl.tokens, 1)
        sel = sum(float((ctl.selected[r] / t).sum()) * s for r, s in strides[layout].items() if r in ctl.sizes)
        miss = sum(float((ctl.missed[r] / t).sum()) * s for r, s in strides[layout].items() if r in ctl.sizes)
        if mode == "dense":  # every unit every token; the cache holds the same units throughout
            sel, miss = float(ffn_bytes[layout]), float(ffn_bytes[layout]) * (1 - ctl.cache_fraction)
        elif layout == "dip" and mode not in ("dip", "wina"):
            sel += L * fd.ffn["hidden_size"] * strides[layout]["inputs"]
        realised = float(ctl.realised()["mlp"].mean())
        ctl.set_mode(mode, count_misses=False, **kw)
        agree = agreement(model, conts) if mode != "dense" else 1.0
        row = {
            "selector": name,
            "density": target,
            "realised_mlp_density": realised,
            "ppl": ppl,
            "agreement": agree,
            "dram_bytes": int(nbytes),
            "layout": layout,
            "cache_fraction": max(cache_bytes, 0) / ffn_bytes[layout],
            "bytes_selected_per_token": sel,
            "bytes_missed_per_token": miss,
            "seconds": time.perf_counter() - t0,
        }
        tqdm.write(
            f"{name:10s} {target:.2f} ppl {ppl:8.3f} agree {agree:.3f} DRAM {nbytes / 2**20:6.2f} MiB "
            f"read {miss / 1024:7.0f} KiB/token ({row['seconds']:.0f}s)"
        )
        return row

    only = set(args.only.split(",")) if args.only else None
    want = lambda name: only is None or name in only or name.split("-")[0] in only  # noqa: E731
    rows = [run("dense", "dense", 1.0, 0)]
    dense = rows[0]["ppl"]
    oracle_bytes = Oracle(fd, 0.5).nbytes
    sketches = {b: build_sketch(weights, xs, b, args.group_size) for b in map(int, args.sketch_bits.split(","))}
    search = {}
    for d in tqdm([float(v) for v in args.densities.split(",")], desc="densities"):
        if want("oracle"):
            rows.append(run("oracle", "oracle", d, oracle_bytes, density=d))
        for name, kw in (("dip", {}), ("wina", norms)):
            if not want(name):
                continue
            s = calibrate_dip(model, ctl, calib[: args.dip_seqs], d, args.dip_candidates, mode=name, **kw)
            search[f"{name} {d}"] = s["search"]
            nb = sum(v.nbytes for v in n_in + n_out) if name == "wina" else 0
            rows.append(
                run(
                    name,
                    name,
                    d,
                    nb,
                    "dip" if "dip" in strides else "neurons",
                    input_density=s["input_density"],
                    neuron_density=s["neuron_density"],
                    **kw,
                )
            )
        for b, arrays in sketches.items():
            if want(f"sketch-{b}b"):
                nb = sum(v.nbytes for a in arrays for v in a.values())
                rows.append(
                    run(
                        f"sketch-{b}b",
                        "sketch",
                        d,
                        nb,
                        sketch=Sketch(arrays, fd.ffn["activation"], b, args.group_size, [d] * L),
                    )
                )
        if args.predictor and want("predictor"):
            pr = train_predictors(fd, xs, d, weights=weights, progress=True)
            nb = sum(v.nbytes for w in pr["weights"] for v in w.values())
            rows.append(run("predictor", "predictor", d, nb, predictors=pr["weights"], predictor_density=d))
            rows[-1]["recall"] = float(np.mean(pr["recall"]))
    if args.append and Path(args.out).is_file():
        new = {(r["selector"], r["density"]) for r in rows}
        old = json.loads(Path(args.out).read_text())
        rows += [r for r in old["rows"] if (r["selector"], r["density"]) not in new]
        search = dict(old.get("dip_search", {}), **search)
    for r in rows:
        r["ppl_increase"] = r["ppl"] / dense - 1
    out = {
        "model": str(fd.path),
        "dense_ppl": dense,
        "held_out_tokens": int(held.shape[0] * (held.shape[1] - 1)),
        "prompts": PROMPTS,
        "gen_tokens": args.gen_tokens,
        "args": vars(args),
        "rows": rows,
        "dip_search": search,
        "machine": machine_info(str(fd.path)),
    }
    Path(args.out).write_text(json.dumps(out, indent=1))
    plot(out, Path(args.out).with_suffix(".png"))
    print(table(out))


def table(out) -> str:
    lines = [
        "| selector | MLP density | perplexity | vs dense | greedy agreement | DRAM (MiB) | KiB/token selected | "
        "KiB/token read (LFU) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in out["rows"]:
        lines.append(
            f"| {r['selector']} | {r['realised_mlp_density']:.2f} | {r['ppl']:.2f} | {r['ppl_increase']:+.1%} | "
            f"{r['agreement']:.3f} | {r['dram_bytes'] / 2**20:.2f} | {r['bytes_selected_per_token'] / 1024:.0f} | "
            f"{r['bytes_missed_per_token'] / 1024:.0f} |"
        )
    return "\n".join(lines)


def plot(out, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    names = list(dict.fromkeys(r["selector"] for r in out["rows"]))
    for name in names:
        pts = sorted(
            (r["bytes_missed_per_token"] / 1024, r["ppl_increase"] * 100, r["density"])
            for r in out["rows"]
            if r["selector"] == name
        )
        x, y, d = zip(*pts)
        style = dict(marker="*", ms=12, ls="none", color="k") if name == "dense" else dict(marker="o")
        ax.plot(x, y, label=name, **style)
        for xi, yi, di in pts:
            if name != "dense":
                ax.annotate(f"{di:.0%}", (xi, yi), fontsize=6, xytext=(2, 2), textcoords="offset points")
    ax.set_yscale("symlog", linthresh=10)
    ax.set_xlabel("KiB read from flash per token (LFU cache at equal DRAM)")
    ax.set_ylabel("perplexity increase vs dense (%)")
    ax.set_title(
        f"{Path(out['model']).name}: selectors at 75/50/30% MLP density ({out['held_out_tokens']} held-out tokens)",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
