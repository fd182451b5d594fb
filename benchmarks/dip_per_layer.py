"""Per-layer DIP densities against the uniform split, at the same mean MLP density, on held-out text.

    python benchmarks/dip_per_layer.py --model DIR [--targets 0.5,0.75] [--sensitivity kl] [--out FILE.json]

DIR: a flash directory converted with --layout dip (nothing is written to it). Calibration: 2 x 256
tokens of the first half of WikiText-2 test (`calibrate_dip_per_layer`: the uniform ratio search, then
per-layer sensitivities and the allocation); held-out: 4 x 256 tokens of the second half, as in
BENCHMARKS.md "Calibration". Prints dense, uniform-DIP and per-layer-DIP perplexity per target, and
the per-layer MLP densities (the per-layer row is measured even when calibration kept the uniform split).
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx_flash  # noqa: E402,F401  (OpenBLAS before mlx.core)
from mlx_flash.calib.dip import calibrate_dip_per_layer, split_density  # noqa: E402
from mlx_flash.calib.quality import eval_model, perplexity
from mlx_flash.format.directory import FlashDir  # noqa: E402
from mlx_flash.loader import load_tokenizer  # noqa: E402
from mlx_flash.texts import read_text, token_batches, wikitext  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="Flash directory with the dip layout.")
    p.add_argument("--data", default=str(wikitext()))
    p.add_argument("--targets", default="0.5,0.75")
    p.add_argument("--sensitivity", choices=["kl", "nll"], default="kl")
    p.add_argument("--calib-seqs", type=int, default=2)
    p.add_argument("--eval-seqs", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--out", default=None, help="JSON with every number and the calibration details.")
    args = p.parse_args()

    fd = FlashDir(args.model)
    tok = load_tokenizer(fd)
    model, ctl = eval_model(fd)
    calib = token_batches(tok, read_text([args.data], "first"), args.seq_len, args.calib_seqs)
    held = token_batches(tok, read_text([args.data], "second"), args.seq_len, args.eval_seqs)
    L = ctl.n_layers
    ctl.set_mode("dense")
    out = {"dense": perplexity(model, ctl, held), "held_out_tokens": int(held.shape[0] * (held.shape[1] - 1))}
    print(f"dense perplexity {out['dense']:.2f} ({out['held_out_tokens']} held-out tokens)", flush=True)
    for t in [float(v) for v in args.targets.split(",")]:
        t0 = time.perf_counter()
        r = calibrate_dip_per_layer(model, ctl, calib, t, sensitivity=args.sensitivity, progress=True)
        secs = time.perf_counter() - t0
        uni = min(r["search"], key=lambda s: s["nll"])
        rows = {}
        sp = [
            split_density(d, uni["input_density"] / t, uni["neuron_density"] / t) for d in r["per_layer"]["mlp_density"]
        ]
        for name, d_in, d_out in (
            ("uniform", [uni["input_density"]] * L, [uni["neuron_density"]] * L),
            ("per-layer", [s[0] for s in sp], [s[1] for s in sp]),
        ):
            ctl.set_mode("dip", input_density=d_in, neuron_density=d_out)
            ppl = perplexity(model, ctl, held)
            rows[name] = {"ppl": ppl, "realised_mlp_density": float(ctl.realised()["mlp"].mean())}
            print(
                f"{t:.0%} {name:9s} perplexity {ppl:.2f} ({(ppl / out['dense'] - 1) * 100:+.1f}% vs dense), "
                f"realised MLP density {rows[name]['realised_mlp_density']:.3f}",
                flush=True,
            )
        pl = r["per_layer"]
        print(
            f"  calibration {secs:.0f} s, chosen {pl['chosen']}; per-layer MLP density: "
            + " ".join(f"{v:.2f}" for v in pl["mlp_density"]),
            flush=True,
        )
        out[str(t)] = {**rows, "calibration_seconds": secs, "calibration": r}
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
