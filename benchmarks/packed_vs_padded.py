"""Packed units (format v3, convert's default) against units padded to the alignment (v1/v2), same weights.

    python benchmarks/packed_vs_padded.py --model GGUF_OR_DIR --memory-budget 50MiB --rounds 3 --json out.json

Converts the model both ways (cached under ~/.cache/mlx_flash/packing/<name>-{packed,padded}), then runs
`python -m mlx_flash.bench --quick` on each, alternating rounds, for a dense sweep (hybrid-prefetch: every
uncached unit each token, in long runs) and scattered sparse reads (sparsity: the oracle stand-in's units, no
cache; all: with the window cache). Prints median ms and device bytes per token of each, and the directory sizes.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from mlx_flash.convert import convert
from mlx_flash.default_model import cache_root, default_gguf_path
from mlx_flash.format.directory import FlashDir

LAYOUTS = {"packed": {}, "padded": {"unit_alignment": None}}  # None: padded to the alignment, as v1/v2


def directory(model: str, layout: str) -> Path:
    out = cache_root() / "packing" / f"{Path(model).stem}-{layout}"
    if not (out / "flash.json").is_file():
        convert(model, out, **LAYOUTS[layout])
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF or model directory (default: the default model's GGUF).")
    p.add_argument("--memory-budget", default="50MiB")
    p.add_argument("--configs", default="hybrid-prefetch,sparsity,all")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    model = args.model or str(default_gguf_path())
    dirs = {k: directory(model, k) for k in LAYOUTS}
    rounds = {k: [] for k in LAYOUTS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for k, d in dirs.items():
                out = Path(tmp) / f"{k}{r}.json"
                subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "mlx_flash.bench",
                        "--model",
                        str(d),
                        "--memory-budget",
                        args.memory_budget,
                        "--quick",
                        "--no-fio",
                        "--configs",
                        args.configs,
                        "--json",
                        str(out),
                    ],
                    check=True,
                    stdout=subprocess.DEVNULL,
                )
                rounds[k].append(json.loads(out.read_text())["configs"])
    sizes = {k: (FlashDir(d).ffn_bytes, FlashDir(d).layouts["neurons"].stride) for k, d in dirs.items()}
    print(
        f"ffn.bin: packed {sizes['packed'][0] / 2**20:.1f} MiB (units {sizes['packed'][1]} B apart), "
        f"padded {sizes['padded'][0] / 2**20:.1f} MiB ({sizes['padded'][1]} B)"
    )
    print("| config | packed ms/token | padded ms/token | packed / padded | packed MiB/token | padded MiB/token |")
    print("|---|---|---|---|---|---|")
    summary = {}
    for c in rounds["packed"][0]:
        ms = {k: statistics.median(r[c]["total_ms"] for r in rounds[k]) for k in rounds}
        mib = {k: statistics.median(r[c]["bytes_per_token"] for r in rounds[k]) / 2**20 for k in rounds}
        summary[c] = {"ms": ms, "mib": mib}
        print(
            f"| {c} | {ms['packed']:.1f} | {ms['padded']:.1f} | {ms['packed'] / ms['padded']:.2f} | "
            f"{mib['packed']:.2f} | {mib['padded']:.2f} |"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {"model": model, "budget": args.memory_budget, "sizes": sizes, "rounds": rounds, "summary": summary},
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
