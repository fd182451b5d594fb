"""Disk space for `convert`: what it writes at its peak, estimated from the source's headers before anything is
written (`SourceWeights.peak_bytes`) and checked against the free space of the output's filesystem
(`check_free_space`); a disk that fills up mid-way ends as DiskSpaceError too (`disk_full_error`).

Everything is written in the output's temporary directory, beside it, so on one filesystem. At once:
  * a GGUF's mlx-lm directory (source.py), a shard per layer written once each; unlinked once the model is loaded
    (lazily), so each shard's space is freed as soon as its arrays are read. A dense model's FFN is not in it: each
    layer's shard is a hole until convert reaches the layer (gguf.FFNHoles);
  * the flash directory: ffn.bin (none where an MoE's experts are read in place), then the resident weights,
    written once (FlashWriter.finish), and the FFN's resident scales (down rows stored as the source's codes)
    a second time in the layers' spool files (build._spooled).
"""

import errno
import math
import os
import re
import shutil
import struct
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

from ..errors import DiskSpaceError, SourceError
from ..format.safetensors_io import read_header as safetensors_header
from .gguf import converted_size, keeps_blocks, kept_dense, kept_experts, read_header
from .gguf_quants import mixed_roles
from .source import read_config, tokenizer_files

# An FFN matrix streamed from flash, as GGUF and mlx-lm / Hugging Face name it; any other tensor is resident.
FFN = re.compile(
    r"\.(ffn_(gate|up|down|gate_up)(_exps)?|(mlp|block_sparse_moe|feed_forward)\.(experts\.(\d+\.)?|switch_mlp\.)?"
    r"(gate_proj|up_proj|gate_up_proj|down_proj|fc1|fc2|w1|w2|w3))\.weight$"
)
DOWN = re.compile(r"(down|fc2|w2)[^.]*\.weight$")
EXPERTS = re.compile(r"_exps\.|\.experts\.|\.switch_mlp\.")
# what the sum leaves out: regions and units padded, unit checksums, the manifest, filesystem blocks
MARGIN = 1.05


@dataclass(frozen=True)
class Weight:
    """A tensor of the model as mlx-lm loads it (a quantised matrix with its scales and biases)."""

    name: str
    values: int
    nbytes: int
    quant: Optional[dict]  # {"bits", "group_size"}; None: floats
    matrix: bool  # one convert quantises when it quantises the model


class SourceWeights:
    """The weights of a conversion source (a GGUF file, or an mlx-lm / Hugging Face directory), from its headers."""

    def __init__(self, source: Path):
        self.gguf = source.is_file()
        kept = stacked = {}  # a GGUF's experts of block types: in place or copied as they are, never in its mlx-lm dir
        if self.gguf:
            header = read_header(source)
            mixed = mixed_roles(header.tensors)
            stacked = kept_experts(header)
            kept = stacked or kept_dense(header, source)  # (a dense FFN's blocks: copied, gguf.kept_dense)
            blocks = keeps_blocks(header, source)
            self.weights = [_gguf_weight(t, mixed, blocks) for t in header.tensors]
            # its tokenizer and config files, at most about twice the GGUF's metadata: in its mlx-lm directory, then
            # copied into the output
            self.files = 2 * 2 * min((t.data_offset for t in header.tensors), default=0)
        else:
            self.weights = _directory_weights(source, read_config(source))
            self.files = sum(f.stat().st_size for f in tokenizer_files(source))
        self.kept = {name: t.n_bytes for name, t in kept.items()}
        ffn = [w for w in self.weights if FFN.search(w.name)]
        self.quant = ffn[0].quant if ffn else None  # convert's: the first layer's FFN's (build._model_quantization)
        self.moe = any(EXPERTS.search(w.name) for w in ffn)
        # experts read in place
        self.stacked = bool(stacked) or (not self.gguf and any(".switch_mlp." in w.name for w in ffn))

    def peak_bytes(
        self, quant, down, resident_scales: bool, float_size: Optional[int], in_place=False, holes=False
    ) -> int:
        """What converting writes at its peak, an upper bound: the model stored quantised as `quant` ({"bits",
        "group_size"}, the source's own, or None: floats of `float_size` bytes, None: the source's), the FFN's
        down rows as `down`, their scales resident if `resident_scales`. `in_place`: the experts are not written;
        `holes`: a GGUF's dense FFN is converted a layer at a time (gguf.FFNHoles).

        A GGUF's mlx-lm directory (its `intermediate`) is a shard per layer, each freed as soon as it is read, as its
        part of the output is written: the disk holds the larger of the two for the FFN and for the resident weights,
        and one shard of the directory besides (the FFN's resident scales twice: spooled, then in the output)."""
        output, scales = {True: 0, False: 0}, 0
        intermediate, layers = {True: 0, False: 0}, {}
        for w in self.weights:
            streamed = bool(FFN.search(w.name))
            q = down if streamed and DOWN.search(w.name) else quant
            stored = self.kept[w.name] if w.name in self.kept else _stored(w, q, self.quant, float_size)
            output[streamed] += 0 if streamed and in_place and self.stacked else stored
            if streamed and resident_scales and q is not None and DOWN.search(w.name):
                scales += 2 * (w.values // q["group_size"]) * (float_size or 2)  # its groups' scales and biases
            if self.gguf and w.name not in self.kept:
                if w.name.startswith("blk."):  # (any other array is a shard of its own, freed as it is read)
                    layer = w.name.split(".")[1]
                    layers[layer] = layers.get(layer, 0) + w.nbytes
                intermediate[streamed] += 0 if streamed and holes and not self.moe else w.nbytes
        largest = max(layers.values(), default=0)
        ffn, resident = (max(output[k], intermediate[k]) for k in (True, False))
        return int(MARGIN * (ffn + resident + largest + self.files + 2 * scales))


def _gguf_weight(t, mixed: set, blocks: bool) -> Weight:
    nbytes, q = converted_size(t, mixed, blocks)
    quant = None if q is None else {"bits": q[1], "group_size": q[0]}
    return Weight(t.name, math.prod(int(x) for x in t.shape), nbytes, quant, len(t.shape) > 1)


def _directory_weights(path: Path, config: dict) -> List[Weight]:
    """The model*.safetensors tensors (what mlx-lm loads), each quantised matrix with its scales and biases."""
    tensors = {}
    for f in sorted(path.glob("model*.safetensors")):
        try:
            for k, t in safetensors_header(f).items():
                if k != "__metadata__":
                    tensors[k] = (math.prod(t["shape"]), t["data_offsets"][1] - t["data_offsets"][0], len(t["shape"]))
        except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
            raise SourceError(f"{f}: unreadable safetensors header ({type(e).__name__}: {e})") from e
    config_quant = config.get("quantization") or {}
    weights = []
    for name, (values, nbytes, ndim) in tensors.items():
        stem, _, part = name.rpartition(".")
        if part in ("scales", "biases") and f"{stem}.weight" in tensors:
            continue  # counted with their weight
        if part == "weight":
            nbytes += sum(tensors[f"{stem}.{p}"][1] for p in ("scales", "biases") if f"{stem}.{p}" in tensors)
        q = config_quant.get(stem, config_quant) if f"{stem}.scales" in tensors else None  # (mlx-lm's way)
        if part == "weight" and isinstance(q, dict) and "bits" in q:
            q = {"bits": q["bits"], "group_size": q.get("group_size", 64)}
            weights.append(Weight(name, values * 32 // q["bits"], nbytes, q, True))
        else:
            weights.append(Weight(name, values, nbytes, None, ndim > 1 and part == "weight"))
    return weights


def _stored(w: Weight, quant, source_quant, float_size: Optional[int]) -> int:
    """Bytes of `w` in a model stored quantised as `quant` (None: floats): the source's quantisation keeps quantised
    weights as they are (their scales cast to `float_size`) and float ones in floats."""
    size = float_size or (2 if w.quant else w.nbytes // max(w.values, 1))  # (dequantised: the scales' float16)
    if w.quant is not None and quant == source_quant:
        return w.nbytes if float_size is None else _quantised(w.values, w.quant, float_size)
    if quant is None or quant == source_quant or not (w.quant or w.matrix):
        return w.values * size
    return _quantised(w.values, quant, size)


def _quantised(values: int, quant: dict, float_size: int) -> int:
    """Codes, scales and biases."""
    return values * quant["bits"] // 8 + 2 * (values // quant["group_size"]) * float_size


def check_free_space(out: Path, needed: int) -> None:
    """DiskSpaceError unless the filesystem `out` is written on has `needed` bytes free."""
    free = shutil.disk_usage(out.parent).free
    if free < needed:
        raise DiskSpaceError(
            f"not enough disk space: needs about {_size(needed)} free on {_mount(out.parent)} for {out}, has "
            f"{_size(free)} (the output, its temporary files and a GGUF's mlx-lm directory at the peak)"
        )


@contextmanager
def disk_full_error(out: Path):
    """ENOSPC or EDQUOT inside (once the contexts within have removed what they wrote) as DiskSpaceError."""
    try:
        yield
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise DiskSpaceError(
            f"{e.filename or _mount(out.parent)}: {e.strerror} (the disk filled up while converting into {out}); what "
            "it wrote is removed"
        ) from e


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _mount(path: Path) -> Path:
    path = path.resolve()
    while not os.path.ismount(path):
        path = path.parent
    return path
