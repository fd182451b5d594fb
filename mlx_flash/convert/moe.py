"""Convert a mixture-of-experts model: each expert of each layer becomes one unit on flash.

The source is whatever mlx-lm loads (a Hugging Face directory with per-expert tensors, which the model's
`sanitize` stacks, or an mlx-community directory with `switch_mlp` stacked): the experts' codes, scales
and biases are written as the source stores them (no re-quantisation, so the weights equal the source's;
symmetric codes such as a GGUF's Q4_0 keep no biases, as the source keeps none);
routers, norms, attention, embeddings and shared experts stay resident.

In place (the default for a directory whose safetensors hold the experts stacked, as mlx-community's do): nothing
of the experts is written; the manifest records where each expert's components lie in the source's files (format
v5, directory.py) and the units' checksums, computed from those bytes in one sequential pass; a GGUF's experts of
GGML block types likewise, as its blocks. `copy=True` or a directory with a tensor per expert (mlx-lm stacks them as
it loads) write the experts into ffn.bin; a GGUF's as its tensors are, read from there as in place (the same rows,
so the same bits as in place).
"""

import os
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Dict, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from tqdm import tqdm

from .. import __version__
from ..compute.blocks import block_kinds
from ..engine.experts import (
    REGION,
    expert_arrays,
    expert_quantization,
    experts_per_token,
    projections,
    switch_paths,
)
from ..errors import FlashError
from ..format import ggml
from ..format.directory import DEFAULT_ALIGNMENT, FFN, PACK_BYTES, FlashWriter
from ..format.layout import BundleLayout, Component, Extent, Region, dtype_name, round_up
from ..format.quant import is_symmetric
from ..format.safetensors_io import DTYPES as SAFETENSORS_DTYPES
from ..format.safetensors_io import read_header
from ..io.sources import FILE_SHIFT
from .source import copy_tokenizer, release

# An expert component read in place is read as the window of whole 512-byte blocks around it (O_DIRECT's unit on
# common disks; one of 4 KiB is read through the pool's bounce buffers, F_NOCACHE has none): a few hundred bytes
# more a component, where 4 KiB windows cost 1-2% of an expert and of the experts a cache holds.
WINDOW_ALIGNMENT = 512
COPY_BYTES = 16 << 20  # (a GGUF's experts copied a chunk at a time: --copy)


def convert_moe(
    model: nn.Module,
    config: dict,
    src_dir: Path,
    work: Path,
    out: Path,
    source: str,
    alignment: int = None,
    progress: bool = True,
    in_place: bool = True,
    ggml: Optional[dict] = None,
    evaluate=None,
) -> Path:
    """Write `model`'s experts and resident weights as a flash directory at `out` (built in `work`); the experts
    referenced in `src_dir`'s files where `in_place` and they are stored there as the model has them, or in the GGUF
    `ggml` (gguf.IN_PLACE's record) names, as its blocks. `evaluate`: FlashWriter.finish's."""
    paths = switch_paths(model)
    top_k = experts_per_token(model, paths)
    modules = dict(model.named_modules())
    alignment = alignment or DEFAULT_ALIGNMENT
    tensors = source_tensors(src_dir, model, paths) if in_place and ggml is None else None
    if in_place and tensors is None and ggml is None:
        print("experts copied into ffn.bin: the source's files do not hold them stacked as the model has them")
    sources = None if tensors is None else {"root": str(Path(src_dir).resolve()), "files": tensors.pop(None)}
    blocks, n_experts = ggml is not None, None
    if blocks:
        f = Path(ggml["file"])
        sources = {"root": str(f.parent), "files": [{"name": f.name, **{k: ggml[k] for k in ("bytes", "mtime_ns")}}]}
    windows = None
    if tensors is not None:
        shapes = BundleLayout.from_arrays(expert_arrays(modules[paths[min(paths)]]), alignment)  # (lazy)
        places = {(i, c.name): tensors[f"{paths[i]}.{c.name}"] for i in paths for c in shapes.components}
        windows = in_place_windows(shapes, places, WINDOW_ALIGNMENT)
    # (units `alignment` apart: an expert read straight into its row)
    writer = FlashWriter(work / "flash", alignment, unit_alignment=alignment, sources=sources)
    if blocks:
        experts = ggml["experts"]
        if not in_place:  # --copy: the tensors as they are into ffn.bin, read from there as from the GGUF
            experts = copy_tensors(f, experts, writer.path / FFN, alignment, progress)
            st = (writer.path / FFN).stat()
            sources = {"root": ".", "files": [{"name": FFN, "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}]}
            writer.sources = sources
        layers = {i: (paths[i], projections(modules[paths[i]])) for i in paths}
        size = sources["files"][0]["bytes"]
        block_quant, block_layout, block_extents, n_experts = ggml_experts(experts, layers, size, alignment)
        sources = {**sources, "root": str(writer.path / sources["root"])}  # (the checksums read it now)
    quant, hidden = None, None
    try:
        sizes = [
            0 if i not in paths
            else block_layout.stride * n_experts if blocks
            else sum(v.nbytes for _, v in tree_flatten(modules[paths[i]].parameters()))
            for i in range(len(model.layers))
        ]  # fmt: skip
        bar = tqdm(total=sum(sizes), desc="experts", unit="B", unit_scale=True, unit_divisor=1024, disable=not progress)
        for i in range(len(model.layers)):
            bar.set_postfix_str(f"layer {i + 1}/{len(sizes)}")
            if i not in paths:
                writer.add_layer({})
                continue
            switch = modules[paths[i]]
            if blocks:  # the GGUF's blocks, in place: only their checksums are read
                quant, extents = block_quant, block_extents[i]
                hidden = quant[projections(switch)[-1]]["out"]
                crcs, crc, _ = unit_checksums(sources, extents, block_layout.stride, n_experts)
                writer.add_layer_in_place({REGION: (block_layout, extents, crcs, crc)})
                parent, name = paths[i].rsplit(".", 1)
                setattr(modules[parent], name, nn.Module())
                bar.update(sizes[i])
                continue
            q = expert_quantization(switch)
            arrays = expert_arrays(switch)
            if sources is None:  # (in place, nothing of them is read but their checksums)
                mx.eval(arrays)
            for name, pq in q.items():  # Q4_0 / Q8_0: the biases follow from the scales, so (as on the source) not
                if (  # stored (in place, they are read as the source stores them)
                    sources is None
                    and pq is not None
                    and f"{name}.biases" in arrays
                    and is_symmetric(arrays[f"{name}.biases"], arrays[f"{name}.scales"], pq["bits"])
                ):
                    q[name] = {**pq, "symmetric": True}
                    del arrays[f"{name}.biases"]
            if quant is not None and q != quant:
                raise ValueError(f"layer {i}: experts quantised as {q}, earlier layers as {quant}")
            quant = q
            n_experts = next(iter(arrays.values())).shape[0]
            hidden = arrays[f"{list(q)[-1]}.weight"].shape[1]  # the last projection's outputs
            if sources is None:
                writer.add_layer({REGION: arrays})
            else:
                places = {c: tensors[f"{paths[i]}.{c}"] for c in arrays}
                layout = BundleLayout.from_arrays(arrays, alignment)
                layout, extents = in_place_layout(layout, places, sources["files"], windows, alignment)
                crcs, crc, row = unit_checksums(sources, extents, layout.stride, n_experts)
                if i == min(paths):  # what mlx-lm loads is what is read: its first expert, byte for byte
                    first = layout.pack({k: v[:1] for k, v in arrays.items()})[0]
                    if any(
                        (
                            row[e.row_offset + e.at : e.row_offset + e.at + c.nbytes]
                            != first[c.offset : c.offset + c.nbytes]
                        ).any()
                        for c, e in zip(layout.components, extents)
                    ):
                        raise FlashError(
                            f"layer {i}: the source's expert bytes differ from what mlx-lm loads of them (its "
                            "sanitize changes them): convert with --copy"
                        )
                writer.add_layer_in_place({REGION: (layout, extents, crcs, crc)})
            parent, name = paths[i].rsplit(".", 1)
            setattr(modules[parent], name, nn.Module())  # the resident set below excludes the experts
            release(switch)  # (`modules` still refers to its modules) its arrays are on flash: freed now
            bar.update(sizes[i])
        bar.close()
        switch = arrays = None
        if blocks:
            quant = {p: {k: v for k, v in q.items() if k != "out"} for p, q in quant.items()}
        resident = dict(tree_flatten(model.parameters()))
        floats = [v.dtype for v in resident.values() if mx.issubdtype(v.dtype, mx.floating)]
        manifest = {
            "architecture": config["model_type"],
            "dtype": dtype_name(floats[0] if floats else mx.float32),
            "quantization": config.get("quantization"),
            "ffn": {
                "kind": "moe",
                "hidden_size": hidden,
                "n_experts": n_experts,
                "experts_per_token": top_k,  # the runtime's read-ahead and buffers for one token's experts
                "switch_paths": {str(k): v for k, v in paths.items()},
                "quantization": quant,
            },
            "source": {"model": str(source), "created_by": f"mlx_flash {__version__}"},
        }
        kept = block_kinds(model)
        release(model)  # `resident` holds the only references: each array is freed once written
        writer.finish(config, resident, manifest, progress, evaluate, kept)
    except BaseException:
        writer.abort()
        raise
    copy_tokenizer(src_dir, writer.path)
    os.replace(writer.path, out)
    return out


def copy_tensors(gguf: Path, experts: dict, out: Path, alignment: int, progress: bool = True) -> dict:
    """The GGUF's stacked expert tensors (gguf.IN_PLACE's `experts`) copied as they are into file `out`, each at a
    multiple of `alignment`, in the GGUF's order: their entries with their offsets there. An entry with a
    `row_stride` (a dense FFN's down rows, gguf.blocked_experts) is stacked on the way: expert e's row j is block e
    of the file's row j."""
    size = {k: e["shape"][0] * e["shape"][1] * ggml.row_bytes(e["type"], e["shape"][2]) for k, e in experts.items()}
    moved, at = {}, 0
    with (
        open(gguf, "rb") as src,
        open(out, "wb") as dst,
        tqdm(
            total=sum(size.values()), desc="experts", unit="B", unit_scale=True, unit_divisor=1024, disable=not progress
        ) as bar,
    ):
        for k, e in sorted(experts.items(), key=lambda kv: kv[1]["offset"]):
            at = round_up(at, alignment)
            moved[k] = {key: v for key, v in e.items() if key != "row_stride"} | {"offset": at}
            n_experts, rows, _ = e["shape"]
            row = size[k] // (n_experts * rows)  # (an expert's row)
            stride = e.get("row_stride", row)  # a row of the file's
            count = size[k] // stride
            per = max(1, COPY_BYTES // stride)
            for j in range(0, count, per):
                n = min(per, count - j) * stride
                data = os.pread(src.fileno(), n, e["offset"] + j * stride)
                if len(data) != n:
                    raise FlashError(f"{gguf}: cut short at byte {e['offset'] + j * stride + len(data)} (changed?)")
                if "row_stride" in e:  # block b of each of the file's rows j.. is expert b's row
                    blocks = np.frombuffer(data, np.uint8).reshape(-1, n_experts, row)
                    for b in range(n_experts):
                        os.pwrite(dst.fileno(), blocks[:, b].tobytes(), at + (b * rows + j) * row)
                else:
                    os.pwrite(dst.fileno(), data, at + j * stride)
                bar.update(n)
            at += size[k]
        dst.truncate(round_up(at, alignment))
    return moved


def ggml_experts(experts: dict, layers: Dict[int, tuple], size: int, alignment: int):
    """(quantisation per projection, the region's layout, {layer: its extents}, experts) of the experts a
    GGUF keeps as GGML blocks (`experts`: gguf.IN_PLACE's, projection path -> type, offset of expert 0, shape
    [experts, out, in]; `layers`: layer -> (switch path, projections); `size`: the file's bytes). A projection's
    component is its rows of blocks, uint8 [out, row bytes]: its type may differ between layers (a Q4_K_M file's
    down projections), so the region's layout holds the largest and each layer's extents its own length; each is
    read as the WINDOW_ALIGNMENT window around it where every stride allows (a GGUF's tensors are 32-byte aligned),
    else as it is."""

    def entry(i, p):
        e = experts.get(f"{layers[i][0]}.{p}")
        if e is None:
            raise FlashError(f"layer {i}: the GGUF holds no stacked {p} experts")
        return e

    names = layers[min(layers)][1]
    quant, n_experts = {}, None
    for p in names:
        es = {i: entry(i, p) for i in layers}
        shapes = {tuple(e["shape"]) for e in es.values()}
        if len(shapes) != 1:
            raise FlashError(f"{p}: experts of shapes {sorted(shapes)} in different layers")
        ((n_experts, out, values),) = shapes
        kinds = {str(i): e["type"] for i, e in es.items()}
        one = set(kinds.values())
        quant[p] = {"ggml": one.pop() if len(one) == 1 else kinds, "values": values, "out": out}
    lengths = {
        i: [quant[p]["out"] * ggml.row_bytes(entry(i, p)["type"], quant[p]["values"]) for p in names] for i in layers
    }
    windowed = all(n % WINDOW_ALIGNMENT == 0 for ls in lengths.values() for n in ls)

    def window(offset, length):
        return round_up(offset % WINDOW_ALIGNMENT + length, WINDOW_ALIGNMENT) if windowed else length

    widest = [max(window(entry(i, p)["offset"], lengths[i][j]) for i in layers) for j, p in enumerate(names)]
    comps, at = [], 0
    for j, p in enumerate(names):
        big = max(lengths[i][j] for i in layers)
        comps.append(Component(f"{p}.weight", "uint8", (quant[p]["out"], big // quant[p]["out"]), at))
        at += widest[j]
    layout = BundleLayout(tuple(comps), round_up(at, alignment))
    per_layer = {}
    for i in layers:
        extents, at = [], 0
        for j, p in enumerate(names):
            offset, n = entry(i, p)["offset"], lengths[i][j]
            phase = offset % WINDOW_ALIGNMENT if windowed else 0
            extents.append(Extent(0, offset - phase, n, window(offset, n), at, phase, n, size))
            at += window(offset, n)
        per_layer[i] = extents
    return quant, layout, per_layer, n_experts


def source_tensors(src_dir: Path, model: nn.Module, paths: Dict[int, str]) -> Optional[dict]:
    """{"<switch path>.<component>": (file index, byte offset of expert 0, bytes between experts)} for every expert
    component of the model, where `src_dir`'s safetensors hold each as the model has it (same name, dtype and
    shape), with None -> the files' manifest entries ({"name", "bytes", "mtime_ns"}); None where any is not."""
    modules = dict(model.named_modules())
    want = {f"{paths[i]}.{k}": v for i in paths for k, v in expert_arrays(modules[paths[i]]).items()}  # (lazy)
    found, files = {}, []
    for f in sorted(Path(src_dir).glob("*.safetensors")):
        try:
            header = read_header(f)
        except (OSError, ValueError):
            return None
        with open(f, "rb") as fh:
            start = 8 + int.from_bytes(fh.read(8), "little")  # the data follow the header
        for k, t in header.items():
            a = want.get(k)
            if a is None or SAFETENSORS_DTYPES.get(a.dtype) != t["dtype"] or list(a.shape) != t["shape"]:
                continue
            if k not in found:
                if not files or files[-1]["name"] != f.name:
                    st = f.stat()
                    files.append({"name": f.name, "bytes": st.st_size, "mtime_ns": st.st_mtime_ns})
                lo, hi = t["data_offsets"]
                found[k] = (len(files) - 1, start + lo, (hi - lo) // a.shape[0])
    if set(found) != set(want):
        return None
    return {**found, None: files}


def in_place_windows(layout: BundleLayout, places: dict, alignment: int):
    """{component: window bytes} when every component of every layer (`places`: {(layer, component): (file,
    offset of expert 0, stride)}) can be read as an aligned window around it straight into its row: strides that are
    multiples of `alignment` (a component then lies at any byte of its window, as its file has it: mlx's safetensors
    are not padded to whole elements; compute/ops.gather copies such a component out). One size a component, the
    largest its layers need, so rows are alike (a layer's component lies at its own offset in its window:
    Region.layout_over). None where they cannot (each component is then read as it is, through the reader's bounce
    buffers)."""
    windows = {}
    for (_, name), (_, offset, stride) in places.items():
        c, phase = layout.component(name), offset % alignment
        if stride % alignment:
            return None
        windows[name] = max(windows.get(name, 0), round_up(phase + c.nbytes, alignment))
    return windows


def in_place_layout(layout: BundleLayout, places: dict, files: list, windows: Optional[dict], alignment: int):
    """(the region's layout, one layer's extents) for experts read in place: `layout`'s components back to back, each
    read as it is; or (`windows`) each in the WINDOW_ALIGNMENT-aligned window of its size, the windows tiling the
    row from its start (rows `alignment` apart: the tail is never read)."""
    if windows is None:
        return layout, [
            Extent(f, o, s, c.nbytes, c.offset, 0, c.nbytes, files[f]["bytes"])
            for c in layout.components
            for f, o, s in [places[c.name]]
        ]
    components, extents, at = [], [], 0
    for c in layout.components:
        file, offset, stride = places[c.name]
        phase = offset % WINDOW_ALIGNMENT
        components.append(replace(c, offset=at))
        extents.append(Extent(file, offset - phase, stride, windows[c.name], at, phase, c.nbytes, files[file]["bytes"]))
        at += windows[c.name]
    return BundleLayout(tuple(components), round_up(at, alignment)), extents


def unit_checksums(sources: dict, extents, stride: int, n_units: int, chunk_bytes: int = PACK_BYTES):
    """(each unit's checksum as the runtime checks it (Region.unit_checksums), the CRC-32 of the units' rows
    [n_units, stride] as read, zero where nothing is read, the first unit's row) from the source files, read a chunk
    of units at a time."""
    root = Path(sources["root"])
    handles = {e.file: open(root / sources["files"][e.file]["name"], "rb") for e in extents}
    region = Region(0, REGION, 0, n_units, stride, 0, tuple(extents))
    units, crc, first = np.empty(n_units, dtype=np.uint32), 0, None
    step = max(1, chunk_bytes // stride)
    try:
        for lo in range(0, n_units, step):
            hi = min(n_units, lo + step)
            rows = np.zeros((hi - lo, stride), dtype=np.uint8)
            offsets, lengths, dest = region.requests(np.arange(lo, hi), np.arange(hi - lo) * stride)
            flat = rows.reshape(-1)
            for o, n, d in zip(offsets.tolist(), lengths.tolist(), dest.tolist()):
                data = os.pread(handles[o >> FILE_SHIFT].fileno(), n, o & ((1 << FILE_SHIFT) - 1))
                flat[d : d + len(data)] = np.frombuffer(data, np.uint8)
            units[lo:hi] = region.unit_checksums(rows, np.arange(hi - lo) * stride)
            crc = zlib.crc32(rows, crc)
            first = rows[0].copy() if first is None else first
    finally:
        for f in handles.values():
            f.close()
    return units, crc, first
