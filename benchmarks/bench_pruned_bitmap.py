"""Wanda-pruned SmolLM2-135M stored as ENDOR bitmap rows vs dense bundles, end to end.

For float16 and 8-bit FFN rows, three flash directories from the default model's GGUF:
dense (not pruned), pruned-dense (--prune wanda --prune-format dense) and pruned-bitmap
(--prune wanda). Per directory:

- bytes on flash (ffn.bin) and per unit (disk stride; data bytes without padding);
- perplexity on 4 x 256 tokens of the second half of WikiText-2 test (quality.eval_model:
  resident, dequantised to float32, dense FFN), like BENCHMARKS.md's other ppl numbers;
  the pruning calibrates on the first half;
- the streaming runtime (oracle sparsifier at 20% density, the same memory budget for
  every directory of a dtype, cold caches): decoded tokens' median bytes read, I/O time and
  bitmap expansion time per token, and hit rate. Tokens are checked identical between
  pruned-dense and pruned-bitmap.
- I/O replay: the same random units (the pruned runs' misses per layer, 30 layers) read
  from each directory's ffn.bin with the runtime's reader (O_DIRECT), one batch per layer,
  --replay tokens; median ms per token. Isolates what the unit size does to read time.
- Expand replay: the same number of units per layer expanded (BundleLayout.expand, MLX ops
  here) and copied into a cache-like host buffer, 30 layers = one token; median ms per token.

    python benchmarks/bench_pruned_bitmap.py [--out DIR] [--tokens 32]
        [--json benchmarks/results/bench_pruned_bitmap.json]

Conversions are cached in --out (default ~/.cache/mlx_flash/pruned-bench) and reused.
"""

import argparse
import json
import time
from pathlib import Path

import mlx_flash  # noqa: F401  (before mlx.core)
from mlx_flash import __version__
from mlx_flash.bench import decode, resident_bytes
from mlx_flash.calib.quality import eval_model, perplexity
from mlx_flash.convert import convert
from mlx_flash.default_model import default_gguf_path
from mlx_flash.format import bitmap
from mlx_flash.format.directory import FlashDir
from mlx_flash.loader import load, load_tokenizer
from mlx_flash.texts import read_text, token_batches
from mlx_flash.tools.bench_io import machine_info

import mlx.core as mx
import numpy as np

VARIANTS = {  # name: convert options
    "f16": dict(dtype="float16", dequantize=True),
    "q8": dict(bits=8, group_size=32),
}
FORMATS = {
    "dense": {},
    "pruned-dense": {"prune": "wanda", "prune_format": "dense"},
    "pruned-bitmap": {"prune": "wanda", "prune_format": "bitmap"},
}


def make(out: Path, variant: str, fmt: str, sparsity: float, seqs: int, seq_len: int) -> Path:
    path = out / f"{variant}-{fmt}"
    if not (path / "flash.json").is_file():
        kw = dict(VARIANTS[variant], **FORMATS[fmt])
        if "prune" in kw:
            kw.update(prune_sparsity=sparsity, prune_seqs=seqs, prune_seq_len=seq_len)
        t = time.perf_counter()
        convert(str(default_gguf_path()), path, **kw)
        print(f"converted {path.name} in {time.perf_counter() - t:.0f} s")
    return path


def ppl(path: Path, n_seqs: int = 4, seq_len: int = 256) -> float:
    fd = FlashDir(path)
    text = read_text(half="second")
    batches = token_batches(load_tokenizer(fd), text[: 16 * n_seqs * (seq_len + 1)], seq_len, n_seqs)
    model, ctl = eval_model(fd, mode="dense")
    return perplexity(model, ctl, batches)


def run(path: Path, budget: int, prompt, tokens: int, density: float) -> dict:
    model, _ = load(path, memory_budget=budget, sparsity="oracle", density=density)
    try:
        decode(model, prompt, 2)  # warm up MLX (compiles, allocations), then cold caches
        model.flash.reset()
        times = decode(model, prompt, tokens)
        model.flash.stats.end()
        toks = model.flash.stats.decode_tokens()
        s = model.flash.stats.summary()
        return {
            "capacity_per_layer": model.flash.plan.capacity[0]["neurons"],
            "bytes_per_token_median": float(np.median([t.bytes_read for t in toks])),
            "bytes_per_token_mean": s["bytes_per_token"],
            "misses_per_token": float(np.mean([t.misses for t in toks])),
            "io_ms": s["io_ms"],
            "expand_ms": s["expand_ms"],
            "mm_ms": s["mm_ms"],
            "total_ms": s["total_ms"],
            "expand_ms_per_miss_unit": 1e3 * sum(t.expand_s for t in toks) / max(1, sum(t.misses for t in toks)),
            "hit_rate": s["hit_rate"],
            "token_ms_wall": 1e3 * float(np.median(times)),
        }
    finally:
        model.flash.close()


def io_replay(path: Path, per_layer: int, tokens: int, seed: int = 0) -> dict:
    from mlx_flash.io.reader import aligned_buffer, open_reader

    fd = FlashDir(path)
    stride = fd.layouts["neurons"].disk_stride
    buf, base = aligned_buffer(per_layer * stride, fd.alignment)
    rng = np.random.default_rng(seed)
    reader = open_reader(fd.ffn_path, direct=True)
    times = []
    try:
        for _ in range(tokens):
            t = time.perf_counter()
            for r in (regions["neurons"] for regions in fd.layers):
                units = np.sort(rng.choice(r.n_units, per_layer, replace=False))
                reader.read(
                    buf, r.offset + units * stride, np.full(per_layer, stride), base + np.arange(per_layer) * stride
                )
            times.append(time.perf_counter() - t)
    finally:
        reader.close()
    return {
        "replay_units_per_layer": per_layer,
        "replay_ms_per_token": 1e3 * float(np.median(times)),
        "replay_mib_per_token": per_layer * len(fd.layers) * stride / 2**20,
    }


def expand_replay(path: Path, per_layer: int, tokens: int, seed: int = 0) -> dict:
    fd = FlashDir(path)
    layout = fd.layouts["neurons"]
    if not layout.encoded:
        return {"expand_replay_ms_per_token": 0.0}
    rng = np.random.default_rng(seed)
    units = [
        mx.array(fd.read_region(i)[np.sort(rng.choice(r["neurons"].n_units, per_layer, replace=False))])
        for i, r in enumerate(fd.layers)
    ]
    mx.eval(units)
    host = np.empty((per_layer, layout.stride), np.uint8)
    times = []
    for _ in range(tokens):
        t = time.perf_counter()
        for u in units:
            rows = layout.expand(u, use_metal=None)
            mx.eval(rows)
            host[:] = np.asarray(rows)
        times.append(time.perf_counter() - t)
    ms = 1e3 * float(np.median(times))
    return {"expand_replay_ms_per_token": ms, "expand_replay_us_per_unit": 1e3 * ms / (per_layer * len(fd.layers))}


def tokens_of(path, budget, prompt, n, density):
    model, _ = load(path, memory_budget=budget, sparsity="oracle", density=density)
    try:
        from mlx_lm.generate import generate_step

        return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]
    finally:
        model.flash.close()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(Path.home() / ".cache" / "mlx_flash" / "pruned-bench"))
    p.add_argument("--variants", default="f16,q8")
    p.add_argument("--sparsity", type=float, default=0.5)
    p.add_argument("--calib-seqs", type=int, default=16)
    p.add_argument("--calib-seq-len", type=int, default=256)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--density", type=float, default=0.2)
    p.add_argument(
        "--budget-fraction",
        type=float,
        default=0.5,
        help="memory budget = resident + KV + scratch + this fraction of the dense unpruned ffn.bin",
    )
    p.add_argument("--replay", type=int, default=20, help="tokens of the I/O replay")
    p.add_argument("--json", default=str(Path(__file__).with_name("bench_pruned_bitmap.json")))
    args = p.parse_args()
    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    res = {
        "machine": machine_info(str(out)),
        "mlx_flash": __version__,
        "metal": bitmap.metal_available(),
        "args": vars(args),
        "results": {},
    }
    print(json.dumps(res["machine"]))
    from mlx_flash.budget import min_budget

    for variant in args.variants.split(","):
        paths = {fmt: make(out, variant, fmt, args.sparsity, args.calib_seqs, args.calib_seq_len) for fmt in FORMATS}
        fd0 = FlashDir(paths["dense"])
        tok = load_tokenizer(fd0)
        prompt = tok.encode("The history of the city begins in the Roman period, when a small settlement")
        for fmt, path in paths.items():
            fd = FlashDir(path)
            layout = fd.layouts["neurons"]
            # the same budget for every directory of the variant: caches of dense rows of the same size
            budget = min_budget(fd, 2048, resident=resident_bytes(fd)) + int(args.budget_fraction * fd0.ffn_bytes)
            r = {
                "ffn_bin_bytes": fd.ffn_bytes,
                "disk_stride": layout.disk_stride,
                "row_stride": layout.stride,
                "unit_data_bytes": layout.disk_nbytes,
                "dense_unit_bytes": layout.nbytes,
                "format_version": fd.version,
            }
            t = time.perf_counter()
            r["ppl"] = ppl(path)
            print(f"{variant} {fmt}: ppl {r['ppl']:.2f} ({time.perf_counter() - t:.0f} s)")
            r.update(run(path, budget, prompt, args.tokens, args.density))
            res["results"][f"{variant}/{fmt}"] = r
            print(variant, fmt, json.dumps(r))
        per_layer = round(res["results"][f"{variant}/pruned-dense"]["misses_per_token"] / len(fd0.layers))
        for rep in range(2):  # alternate the formats, twice, against drifting load
            for fmt, path in paths.items():
                r = io_replay(path, per_layer, args.replay, seed=rep)
                r.update(expand_replay(path, per_layer, args.replay, seed=rep))
                res["results"][f"{variant}/{fmt}"].setdefault("replay", []).append(r)
                print(variant, fmt, "replay", json.dumps(r))
        budget = min_budget(fd0, 2048, resident=resident_bytes(fd0)) + int(args.budget_fraction * fd0.ffn_bytes)
        same = tokens_of(paths["pruned-dense"], budget, prompt, 16, args.density) == tokens_of(
            paths["pruned-bitmap"], budget, prompt, 16, args.density
        )
        res["results"][f"{variant}/bitmap_tokens_equal_pruned_dense"] = same
        print(f"{variant}: pruned-bitmap greedy tokens == pruned-dense: {same}")
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    print(table(res))


def table(res) -> str:
    rows = [
        "| rows | format | ffn.bin MiB | B/unit on flash (data) | ratio vs dense | ppl | KiB read/token | "
        "I/O speed-up | io ms/token | expand ms/token | hit rate | replay: read ms/token | "
        "replay: expand ms/token |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, r in res["results"].items():
        if not isinstance(r, dict):
            continue
        variant, fmt = key.split("/")
        base = res["results"][f"{variant}/dense"]
        replay = " / ".join(f"{x['replay_ms_per_token']:.1f}" for x in r.get("replay", []))
        expand = " / ".join(f"{x['expand_replay_ms_per_token']:.1f}" for x in r.get("replay", []))
        rows.append(
            f"| {variant} | {fmt} | {r['ffn_bin_bytes'] / 2**20:.1f} | {r['disk_stride']} ({r['unit_data_bytes']}) | "
            f"{r['disk_stride'] / base['disk_stride']:.3f} | {r['ppl']:.2f} | {r['bytes_per_token_mean'] / 1024:.0f} | "
            f"{base['bytes_per_token_mean'] / r['bytes_per_token_mean']:.2f}x | {r['io_ms']:.1f} | "
            f"{r['expand_ms']:.1f} | {r['hit_rate']:.1%} | {replay} | {expand} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    main()
