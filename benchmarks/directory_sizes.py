"""A flash directory's bytes against its GGUF's: resident weights, its units (ffn.bin, or read in place), and their
sum over the GGUF's tensor data.

    python benchmarks/directory_sizes.py --model DIR --gguf FILE [--model DIR2 --gguf FILE2 ...] [--json OUT]

The units against the GGUF's FFN tensors is what a token's reads cost against reading the file as stored: ffn.bin,
or for units read in place the windows every unit's reads take once; beside them, what ffn.bin holds where the
GGUF's FFN tensors are copied as MLX's affine codes (`convert --copy`: gguf.converted_size, without writing it).

Defaults to the default model (its cache directory and the GGUF it was converted from).
"""

import argparse
import json
import os

import mlx_flash  # noqa: F401  (OpenBLAS before mlx.core)
from mlx_flash.default_model import default_gguf_path, default_model_dir
from mlx_flash.format.directory import FlashDir


def sizes(model, gguf_path) -> dict:
    from mlx_flash.convert.gguf import converted_size, read_header
    from mlx_flash.convert.gguf_quants import mixed_roles

    import gguf

    fd = FlashDir(model)
    reader = gguf.GGUFReader(gguf_path)
    tensors = sum(int(t.n_bytes) for t in reader.tensors)
    ffn = sum(int(t.n_bytes) for t in reader.tensors if ".ffn_" in t.name and len(t.shape) > 1)
    header = read_header(gguf_path)
    mixed = mixed_roles(header.tensors)
    copied = sum(converted_size(t, mixed)[0] for t in header.tensors if ".ffn_" in t.name and len(t.shape) > 1)
    in_place = fd.sources is not None
    ffn_bin = 0 if in_place else os.path.getsize(fd.ffn_path)
    units = sum(r.n_units * sum(e.nbytes for e in r.extents) for r in fd.regions()) if in_place else ffn_bin
    weights = fd.resident_bytes + units
    directory = sum(f.stat().st_size for f in fd.path.iterdir() if f.is_file())  # tokenizer and manifest too
    biases = sum(t.nbytes for k, t in fd.resident_index().items() if k.endswith(".biases"))
    return {
        "model": str(model),
        "format_version": fd.version,
        "resident": fd.resident_bytes,
        "resident_biases": biases,
        "symmetric_modules": len(fd.symmetric),
        "units_in_place": in_place,
        "ffn_bin": ffn_bin,
        "units": units,
        "gguf_ffn_tensors": ffn,
        "units_over_gguf_ffn": units / ffn,
        "copied_ffn": copied,
        "copied_over_gguf_ffn": copied / ffn,
        "weights": weights,
        "gguf_tensors": tensors,
        "gguf_file": os.path.getsize(gguf_path),
        "weights_over_gguf_tensors": weights / tensors,
        "directory": directory,
        "directory_over_gguf_file": directory / os.path.getsize(gguf_path),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", default=None)
    p.add_argument("--gguf", action="append", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    models, ggufs = args.model or [default_model_dir()], args.gguf or [default_gguf_path()]
    if len(models) != len(ggufs):
        p.error("give one --gguf per --model")
    print(
        "| directory | format | resident.safetensors (biases in it) | units (ffn.bin or in place) / GGUF FFN tensors "
        "| copied as MLX codes / GGUF FFN | weights / GGUF tensor data | directory / GGUF file |"
    )
    print("|---|---|---|---|---|---|---|")
    rows = []
    for m, g in zip(models, ggufs):
        s = sizes(m, g)
        rows.append(s)
        print(
            f"| {m} | v{s['format_version']} | {s['resident']:,} B ({s['resident_biases']:,} B) | "
            f"{s['units']:,} {'in place' if s['units_in_place'] else 'ffn.bin'} / {s['gguf_ffn_tensors']:,} B = "
            f"{s['units_over_gguf_ffn']:.3f}x | {s['copied_over_gguf_ffn']:.3f}x | "
            f"{s['weights']:,} / {s['gguf_tensors']:,} B = {s['weights_over_gguf_tensors']:.4f}x | "
            f"{s['directory']:,} / {s['gguf_file']:,} B = {s['directory_over_gguf_file']:.4f}x |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
