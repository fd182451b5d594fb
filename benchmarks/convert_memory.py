"""Convert under a hard memory cap: peak memory, time and the output against an uncapped conversion, byte for byte.

    python benchmarks/convert_memory.py --model ~/.cache/mlx_flash/peers/llama-7b/model.Q4_0.gguf \
        --caps 2GiB,1GiB [--work DIR] [--json benchmarks/results/convert_memory_llama7b.json]

Each conversion is `python -m mlx_flash.convert --model SRC --out DIR` (convert's defaults) run by
`python -m mlx_flash.tools.cap --limit CAP --drop SRC` (the source dropped from the page cache first); the first
runs without a cap and is the reference every other output is compared with (sha256 of every file). Outputs are
deleted after comparison (a GGUF's conversion needs about twice its size in free disk while it runs).
"""

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import mlx_flash  # noqa: F401  (OpenBLAS before mlx.core)
from mlx_flash.tools.bench_io import machine_info
from mlx_flash.tools.peers_systems import versions


def digests(root: Path) -> dict:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h = hashlib.sha256()
            with open(p, "rb") as f:
                for block in iter(lambda: f.read(1 << 24), b""):
                    h.update(block)
            out[str(p.relative_to(root))] = h.hexdigest()
    return out


def convert_capped(model: str, out: Path, cap: str) -> dict:
    cmd = [sys.executable, "-m", "mlx_flash.tools.cap", "--limit", cap, "--drop", model, "--json", "--",
           sys.executable, "-m", "mlx_flash.convert", "--model", model, "--out", str(out)]  # fmt: skip
    report = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    keep = ("limit", "backend", "returncode", "oom_killed", "cgroup_peak", "max_rss", "read_bytes", "wall_s")
    return {k: report[k] for k in keep}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="The source: a GGUF file, an mlx-community or HF directory.")
    p.add_argument("--caps", default="2GiB,1GiB", help="Hard caps, comma-separated (an uncapped run comes first).")
    p.add_argument("--work", default=None, help="Where the outputs go while compared (default: beside the model).")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    work = Path(args.work or Path(args.model).expanduser().resolve().parent / "convert_memory")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    runs, reference = [], None
    try:
        for cap in ["none", *args.caps.split(",")]:
            out = work / f"out-{cap}"
            run = {"cap": cap, **convert_capped(args.model, out, cap)}
            if run["returncode"] == 0:
                got = digests(out)
                reference = reference or got
                run["identical_to_uncapped"] = got == reference
                run["output_bytes"] = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
            shutil.rmtree(out, ignore_errors=True)
            runs.append(run)
            print(json.dumps(run), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res = {"model": args.model, "source_bytes": Path(args.model).expanduser().stat().st_size, "runs": runs,
           "machine": machine_info(str(work.parent)), "versions": versions()}  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
