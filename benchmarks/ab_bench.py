"""Same-run A/B of `python -m mlx_flash.bench` between two checkouts (e.g. the commit before a change and after),
or two model directories (e.g. two conversions of one GGUF) with one checkout.

    python benchmarks/ab_bench.py --old /tmp/ab-old --new . --rounds 3 -- --memory-budget 50% --quick --no-fio
    python benchmarks/ab_bench.py --old . --new . --old-model A --new-model B -- --memory-budget 2300MiB ...

Each round runs the bench once per checkout, alternating (the disk is noisy: alternate, take medians), with
PYTHONPATH set to the checkout (its compiled extensions built in place: `python setup.py build_ext --inplace`).
Prints, per configuration, the median ms per token and device bytes per token of each side and new / old;
--json keeps every round.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run(checkout: Path, bench_args, json_path: Path, cache: Path = None) -> dict:
    env = dict(os.environ, PYTHONPATH=str(checkout), **({"MLX_FLASH_CACHE": str(cache)} if cache else {}))
    subprocess.run(
        [sys.executable, "-m", "mlx_flash.bench", *bench_args, "--json", str(json_path)],
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
        cwd=tempfile.gettempdir(),
    )
    return json.loads(json_path.read_text())


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", type=Path, required=True)
    p.add_argument("--new", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument(
        "--separate-caches",
        type=Path,
        default=None,
        help="Give each side its own MLX_FLASH_CACHE under this folder (when their formats differ, e.g. the "
        "synthetic models each builds).",
    )
    p.add_argument("--old-model", default=None, help="--model of the old side's bench (else the bench args')")
    p.add_argument("--new-model", default=None, help="--model of the new side's bench")
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="after --: the bench's own arguments")
    args = p.parse_args()
    bench_args = [a for a in args.bench_args if a != "--"]
    side_args = {
        s: bench_args + (["--model", m] if m else []) for s, m in (("old", args.old_model), ("new", args.new_model))
    }
    rounds = {"old": [], "new": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for side in ("old", "new"):
                cache = args.separate_caches / side if args.separate_caches else None
                res = run(getattr(args, side).resolve(), side_args[side], Path(tmp) / f"{side}{r}.json", cache)
                rounds[side].append(res["configs"])
                print(
                    f"round {r + 1} {side}: "
                    + ", ".join(f"{k} {v['total_ms']:.1f} ms" for k, v in res["configs"].items()),
                    file=sys.stderr,
                )
    configs = [c for c in rounds["old"][0] if c in rounds["new"][0]]
    print("| config | old ms/token | new ms/token | new / old | old MiB/token | new MiB/token |")
    print("|---|---|---|---|---|---|")
    summary = {}
    for c in configs:
        ms = {s: statistics.median(r[c]["total_ms"] for r in rounds[s]) for s in rounds}
        mib = {s: statistics.median(r[c].get("bytes_per_token", 0) for r in rounds[s]) / 2**20 for s in rounds}
        summary[c] = {"ms": ms, "mib": mib, "ratio": ms["new"] / ms["old"]}
        print(
            f"| {c} | {ms['old']:.1f} | {ms['new']:.1f} | {ms['new'] / ms['old']:.2f} | "
            f"{mib['old']:.1f} | {mib['new']:.1f} |"
        )
    if args.json:
        args.json.write_text(json.dumps({"args": side_args, "rounds": rounds, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
