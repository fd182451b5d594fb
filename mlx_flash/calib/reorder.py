"""Neuron order on flash: put neurons that fire often and together next to each other.

The reader coalesces neighbouring units into one larger request, so the fewer gaps
between a token's active units, the fewer and longer the reads. `neuron_order` chains
neurons greedily: start at the most frequently active neuron, then repeatedly append the
unplaced neuron that was most often active together with the last placed one (ties: the
more frequent). Hot neurons come first (they co-occur with everything), and neurons of a
co-activation cluster end up adjacent.

`reorder` rewrites a flash directory with a permutation per layer applied to everything
indexed by neuron: the "neurons" units (bundles, or down rows in the dip layout), the
neuron axis inside the dip layout's "inputs" units, resident per-neuron tensors (fc1 bias
of ReLU models), and predictor B rows. The model computes exactly the same function (a
permutation of a sum); the manifest's "neuron_order" records, per layer, stored position
-> original neuron. When the dip layout's inputs are quantised along the neuron axis, only
whole quantisation groups can move without re-quantising: the order is then chained over
groups (`group` > 1) and the bytes are moved group by group, bit-exactly.

The new directory is written beside the old one under a temporary name, then swapped in
with two renames (the old one is removed last).
"""

import os
import shutil
from pathlib import Path
from typing import Sequence

import mlx.core as mx
import numpy as np
from tqdm import tqdm

from ..budget import min_budget
from ..engine.sparsity import dram_bytes
from ..format.directory import FFN, MANIFEST, PREDICTORS, RESIDENT, FlashDir, FlashWriter
from ..generate import generate_step
from ..loader import load, load_tokenizer, make_sparsifier
from ..texts import read_text, token_batches
from .quality import activation_targets, collect_inputs, dense_ffn_weights, eval_model

_GENERATED = ("format", "format_version", "alignment", "layouts", "layers", "resident", "ffn_file")


def neuron_order(masks: np.ndarray, group: int = 1) -> np.ndarray:
    """Permutation (stored position -> original neuron) from active sets `masks` [T, n] bool.

    group > 1: neurons move in consecutive blocks of `group` (block activity = how many of its
    neurons are active)."""
    m = np.asarray(masks, dtype=np.float32)
    T, n = m.shape
    if group > 1:
        if n % group:
            raise ValueError(f"{n} neurons are not a multiple of the group size {group}")
        m = m.reshape(T, n // group, group).sum(-1)
    k = m.shape[1]
    co = m.T @ m  # co-activation counts
    freq = np.diag(co).copy()
    placed = np.zeros(k, dtype=bool)
    order = np.empty(k, dtype=np.int64)
    cur = int(np.argmax(freq))
    tie = freq / (freq.max() + 1.0) * 0.5  # < 1 count: only breaks ties
    for pos in range(k):
        order[pos] = cur
        placed[cur] = True
        if pos == k - 1:
            break
        score = np.where(placed, -np.inf, co[cur] + tie)
        cur = int(np.argmax(score))
    if group > 1:
        order = (order[:, None] * group + np.arange(group)[None, :]).reshape(-1)
    return order.astype(np.int32)


def reorder_group(fd: FlashDir) -> int:
    """The granularity at which neurons may move bit-exactly (1, or the dip inputs' quantisation group)."""
    if "inputs" not in fd.layers[0]:
        return 1
    q = fd.ffn["matrices"]["gate"]["quantization"]
    return int(q["group_size"]) if q else 1


def _permute_inputs(arrays, perm: np.ndarray, group: int):
    """Permute the neuron axis inside dip "inputs" units ([d, n] floats, or [d, n*bits/32] packed + [d, n/g] scales)."""
    out = {}
    blocks = perm.reshape(-1, group)[:, 0] // group if group > 1 else None
    for name, a in arrays.items():
        if group == 1:
            out[name] = a[:, mx.array(perm)]
        else:
            d = a.shape[0]
            g = a.reshape(d, len(blocks), -1)  # [d, groups, per-group elements]
            out[name] = g[:, mx.array(blocks)].reshape(a.shape)
    return out


def reorder(path, perms: Sequence[np.ndarray], progress: bool = False) -> Path:
    """Rewrite the flash directory at `path` with neuron permutation perms[i] (position -> neuron) in layer i."""
    path = Path(path).resolve()
    fd = FlashDir(path)
    group = reorder_group(fd)
    n = fd.ffn["intermediate_size"]
    perms = [np.asarray(p, dtype=np.int32) for p in perms]
    for i, p in enumerate(perms):
        if len(p) != n or not np.array_equal(np.sort(p), np.arange(n)):
            raise ValueError(f"layer {i}: not a permutation of {n} neurons")
        if group > 1 and not np.array_equal(
            p.reshape(-1, group) - p.reshape(-1, group)[:, :1], np.tile(np.arange(group), (n // group, 1))
        ):
            raise ValueError(f"layer {i}: quantised dip inputs can only move whole groups of {group} neurons")
    tmp = path.with_name(f".{path.name}.reorder.tmp")
    old = path.with_name(f".{path.name}.reorder.old")
    for d in (tmp, old):
        if d.exists():
            shutil.rmtree(d)
    writer = FlashWriter(
        tmp, fd.alignment, {k: e for l in fd.layouts.values() for k, e in l.encodings().items()}, fd.unit_alignment
    )
    try:
        for i in tqdm(range(len(fd.layers)), desc="reorder", unit="layer", disable=not progress):
            regions = {}
            pm = mx.array(perms[i])
            for name in fd.layers[i]:
                layout = fd.layouts[name]
                arrays = layout.unpack(layout.expand(mx.array(fd.read_region(i, name))))
                if name == "neurons":
                    regions[name] = {k: v[pm] for k, v in arrays.items()}
                else:
                    regions[name] = _permute_inputs(arrays, perms[i], group)
                mx.eval(regions[name])
            writer.add_layer(regions)
        resident = fd.load_resident()
        for i, mlp in enumerate(fd.ffn["mlp_paths"]):
            key = f"{mlp}.fc1.bias"
            if key in resident:
                resident[key] = resident[key][mx.array(perms[i])]
        old_order = fd.manifest.get("neuron_order")
        order = [(np.asarray(old_order[i])[perms[i]] if old_order else perms[i]).tolist() for i in range(len(perms))]
        manifest = {k: v for k, v in fd.manifest.items() if k not in _GENERATED}
        manifest["neuron_order"] = order
        writer.finish(fd.config, resident, manifest)
    except BaseException:
        writer.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    preds = fd.load_predictors()
    if preds is not None:
        arrays = {}
        for i, w in enumerate(preds):
            arrays[f"{i}.A"] = w["A"]
            arrays[f"{i}.B"] = w["B"][mx.array(perms[i])]
        mx.save_safetensors(str(tmp / fd.manifest["sparsity"]["predictor"]["file"]), arrays)
    for f in path.iterdir():  # tokenizer and other files
        if (
            f.name not in (MANIFEST, RESIDENT, FFN, PREDICTORS, "config.json")
            and f.is_file()
            and not (tmp / f.name).exists()
        ):
            shutil.copy2(f, tmp / f.name)
    os.rename(path, old)
    os.rename(tmp, path)
    shutil.rmtree(old)
    return path


def read_stats(
    path,
    sparsity: str = "auto",
    cache_fraction: float = 0.1,
    tokens: int = 32,
    prompt: str = "The history of",
    context: int = 256,
    **load_kw,
) -> dict:
    """Decode greedily with mlx_flash.load under a budget that caches `cache_fraction` of the FFN
    and return the reader's counters for the decode steps (and the tokens)."""
    fd = FlashDir(path)
    resident = fd.resident_nbytes(lambda k: "float32")
    sp = make_sparsifier(fd, sparsity, load_kw.pop("density", None), load_kw.pop("gamma", 1.0))
    extra = dram_bytes(sp)
    budget = min_budget(fd, context, extra=extra, resident=resident) + int(cache_fraction * fd.ffn_bytes)
    model, tok = load(path, memory_budget=budget, sparsifier=sp, context=context, **load_kw)
    try:
        ids = mx.array(tok.encode(prompt))
        gen = generate_step(ids, model, max_tokens=tokens)
        first = next(gen)[0]
        model.flash.reader.reset_stats()  # decode steps only (the prompt streams every unit)
        out = [int(first)] + [int(t) for t, _ in gen]
        s = dict(model.flash.reader.stats())
    finally:
        model.flash.close()
    s["tokens"] = out
    s["bytes_per_request"] = s["bytes_requested"] / max(s["requests"], 1)
    return s


def setup_arg_parser():
    import argparse

    p = argparse.ArgumentParser(
        description="Reorder a flash directory's neurons by co-activation on calibration text "
        "and report the mean bytes per read request while decoding, before and after."
    )
    p.add_argument("--model", required=True, help="Flash directory (rewritten in place).")
    p.add_argument("--data", nargs="+", default=None, help="Calibration text (default: first half of WikiText-2 test).")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--num-seqs", type=int, default=4)
    p.add_argument("--density", type=float, default=0.5, help="SwiGLU: active = top-K of |GLU| at this density.")
    p.add_argument("--sparsity", default="auto", help="Sparsifier for the decoding measurement.")
    p.add_argument("--cache-fraction", type=float, default=0.1, help="Budget: share of the FFN the caches hold.")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt", default="The history of the Roman Empire")
    return p


def main():

    args = setup_arg_parser().parse_args()
    fd = FlashDir(args.model)
    kw = dict(sparsity=args.sparsity, cache_fraction=args.cache_fraction, tokens=args.max_tokens, prompt=args.prompt)
    if args.sparsity in ("oracle", "dip"):
        kw["density"] = args.density
    before = read_stats(fd.path, **kw)
    model, ctl = eval_model(fd)
    text = read_text(args.data, "first")
    xs = collect_inputs(model, ctl, token_batches(load_tokenizer(fd), text, args.seq_len, args.num_seqs), True)
    del model
    group = reorder_group(fd)
    perms = [
        neuron_order(
            activation_targets(x, dense_ffn_weights(fd, i), fd.ffn["kind"], fd.ffn["activation"], args.density), group
        )
        for i, x in enumerate(xs)
    ]
    reorder(fd.path, perms, progress=True)
    after = read_stats(fd.path, **kw)
    for name, s in (("before", before), ("after", after)):
        print(
            f"{name}: {s['requests']} requests, {s['bytes_requested'] / 2**20:.1f} MiB requested, "
            f"{s['bytes_per_request']:.0f} B per request, {s['bytes_read'] / 2**20:.1f} MiB read"
        )
    print("identical tokens:", before["tokens"] == after["tokens"])


if __name__ == "__main__":
    main()
