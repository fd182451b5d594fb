"""Peak extra disk of `convert`: the used bytes of the output's filesystem sampled every millisecond while each source
converts, against the bytes of the output (and of its resident file: read in place, an MoE's experts are not written).

    python benchmarks/convert_disk.py --model llama-7b.Q4_0.gguf --model qwen3-30b.Q4_0.gguf --work DIR \
        --json benchmarks/results/convert_disk.json

DIR's filesystem is the one measured (the used bytes count files still open after they are unlinked, which `du`
misses): keep nothing else writing to it meanwhile. Each output is removed after it is measured unless --keep.
"""

import argparse
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlx_flash  # noqa: F401  (OpenBLAS before mlx.core)
from mlx_flash.format.directory import FlashDir
from mlx_flash.tools.bench_io import machine_info
from mlx_flash.tools.peers_systems import versions


def convert_sampled(source: Path, out: Path, *flags: str) -> dict:
    """`python -m mlx_flash.convert --model SOURCE --out OUT FLAGS`, the used bytes of OUT's filesystem sampled:
    the peak above what was used before, the output's bytes, wall time."""
    before = shutil.disk_usage(out.parent).used
    peak, done = [before], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], shutil.disk_usage(out.parent).used)
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t = time.perf_counter()
    cmd = [sys.executable, "-m", "mlx_flash.convert", "--model", str(source), "--out", str(out), *flags]
    r = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t
    done.set()
    sampler.join()
    if r.returncode:
        raise SystemExit(f"convert failed: {r.stderr[-2000:]}")
    fd = FlashDir(out)
    written = sum(f.stat().st_size for f in out.iterdir())
    extra = peak[0] - before
    return {
        "wall_s": wall,
        "peak_extra_disk": extra,
        "output_bytes": written,
        "resident_bytes": fd.resident_bytes,
        "model_bytes": fd.model_bytes,
        "in_place": fd.sources is not None,
        "output_of_model": written / fd.model_bytes,
        "peak_of_output": extra / written,
        "peak_of_resident": extra / fd.resident_bytes,
        "stdout_tail": r.stdout[-300:],
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", required=True, help="A source to convert (repeatable).")
    p.add_argument("--work", required=True, help="A directory on the filesystem measured.")
    p.add_argument("--copy", action="store_true", help="Pass --copy (experts written into ffn.bin).")
    p.add_argument("--keep", action="store_true", help="Keep the outputs.")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {"machine": machine_info(str(work)), "versions": versions(), "commit": commit, "runs": []}
    for model in args.model:
        source = Path(model)
        out = work / f"{source.stem}.flash"
        shutil.rmtree(out, ignore_errors=True)
        run = {"model": str(source), "source_bytes": source.stat().st_size if source.is_file() else None}
        run.update(convert_sampled(source, out, *(["--copy"] if args.copy else [])))
        report["runs"].append(run)
        print(
            f"{source.name}: peak extra disk {run['peak_extra_disk'] / 2**20:,.1f} MiB, output "
            f"{run['output_bytes'] / 2**20:,.1f} MiB ({run['peak_of_output']:.3f}x), resident file "
            f"{run['resident_bytes'] / 2**20:,.1f} MiB ({run['peak_of_resident']:.3f}x), {run['wall_s']:.0f} s",
            flush=True,
        )
        if not args.keep:
            shutil.rmtree(out)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
