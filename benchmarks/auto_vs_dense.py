"""--sparsity auto against dense on the default model after the default `calibrate`: device bytes a token.

    python benchmarks/auto_vs_dense.py --budgets 25% 50% 80% --json benchmarks/results/auto_vs_dense_smollm2.json

Copies the default model's directory (calibrate writes into the directory it calibrates; the user's stays as it
is), runs `python -m mlx_flash.calibrate` on the copy with its defaults, then at each budget
`python -m mlx_flash.generate --stats` with --sparsity auto and dense (the same prompt, 32 tokens), and reads the
device bytes a token, the selector auto chose and why, from --stats.
"""

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from mlx_flash.default_model import default_model_dir

PROMPT = "Summarise the history of the lighthouse in three sentences."


def generate(path: Path, budget: str, sparsity: str) -> dict:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_flash.generate",
            "--model",
            str(path),
            "--prompt",
            PROMPT,
            "--max-tokens",
            "32",
            "--memory-budget",
            budget,
            "--sparsity",
            sparsity,
            "--stats",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    read = re.search(r"read ([\d.]+) (KiB|MiB|GiB)/token at the device", r.stdout)
    scale = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[read.group(2)]
    selector = re.search(r"^selector: (\w+)", r.stdout, re.M).group(1)
    why = re.search(r"^auto: .*$", r.stdout, re.M)
    return {"bytes_per_token": float(read.group(1)) * scale, "selector": selector, "why": why and why.group(0)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budgets", nargs="+", default=["25%", "50%", "80%"])
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "smollm2"
        shutil.copytree(default_model_dir(), path)
        subprocess.run([sys.executable, "-m", "mlx_flash.calibrate", "--model", str(path), "--quiet"], check=True)
        selector = json.loads((path / "flash.json").read_text()).get("sparsity", {}).get("selector")
        rows = {b: {s: generate(path, b, s) for s in ("auto", "dense")} for b in args.budgets}
    shown = selector and {k: selector[k] for k in ("name", "bits", "ppl_increase") if k in selector}
    print(f"calibrated selector: {shown}")
    print("| budget | auto picks | auto MiB/token | dense MiB/token | auto / dense |")
    print("|---|---|---|---|---|")
    for b, r in rows.items():
        a, d = r["auto"]["bytes_per_token"], r["dense"]["bytes_per_token"]
        print(f"| {b} | {r['auto']['selector']} | {a / 2**20:.1f} | {d / 2**20:.1f} | {a / d:.2f} |")
    for b, r in rows.items():
        print(f"{b}: {r['auto']['why']}")
    if args.json:
        args.json.write_text(json.dumps({"selector": selector, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
