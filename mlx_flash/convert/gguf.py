"""GGUF file -> mlx-lm model directory.

`gguf_to_mlx_dir(path, out_dir)` writes `config.json` (Hugging Face style, with
mlx-lm's `quantization` block when weights are quantised), `model*.safetensors`
(weights under mlx-lm's names) and the tokenizer files, so the rest of mlx_flash
only ever reads mlx-lm / Hugging Face directories.

Weights: gguf_quants.py says what each GGUF type becomes (most exactly, the rest re-quantised to 8 bits).
  * Every header is parsed and checked first (GGUFFile, in pure Python: mx.load
    trusts every length and offset in it). Files made only of the first kind and
    no larger than MX_LOAD_MAX_BYTES are then read by `mx.load` (fast path).
    Other files are memory-mapped and read a tensor at a time, each tensor
    spooled to disk as it is converted, so peak memory is about one tensor. Both
    paths write bit-identical weights.
  * llama.cpp's converter permutes the rows of attn_q / attn_k of llama-style
    models for its RoPE layout; the permutation is undone here (it commutes with
    per-row quantisation, so .weight/.scales/.biases rows are permuted alike).
    Qwen2/3, Phi-3 and Gemma 3 use NeoX-style RoPE and are stored unpermuted.
  * Gemma's RMSNorms compute x * (1 + w); llama.cpp stores every norm weight as
    w + 1 (ArchSpec.norm_shift), which is subtracted again.

Tokenizer
  GGUF keeps the tokenizer as metadata (tokens, merges or scores, token types,
  special ids, chat template). It is rebuilt with the `tokenizers` library and
  saved as a transformers PreTrainedTokenizerFast (no torch needed):
  * "gpt2" (byte-level BPE: SmolLM2, Llama 3, Qwen2): tokens + merges, with the
    pre-tokenizer llama.cpp uses for `tokenizer.ggml.pre`;
  * "llama" (SentencePiece BPE: Llama 2, Mistral, TinyLlama): byte-fallback BPE
    with merges derived from the scores, as transformers' LlamaTokenizerFast
    (legacy) does; a space is prefixed to each text run, also after special
    tokens, like llama.cpp.
  Control tokens become special tokens; BOS/EOS are added as the GGUF says.

Architectures are described by `ArchSpec` entries in `ARCHITECTURES` (GGUF
tensor names -> mlx-lm names, which rows to unpermute, norm offsets, and the
config builder); add an entry to support another one. Supported: llama (and
Mistral, which llama.cpp also calls "llama"), mistral, qwen2, qwen3, phi3
(fused attn_qkv and ffn_up -> qkv_proj / gate_up_proj) and gemma3 (->
gemma3_text, with llama.cpp's fixed defaults for what the GGUF leaves out:
sliding window pattern 6, local RoPE base 10000, query scale from head_dim).
Mixture of experts (stacked ffn_*_exps, router ffn_gate_inp): qwen3moe, qwen2moe (shared expert *_shexp),
olmoe, Mixtral (llama.cpp's "llama" with an expert_count), gpt-oss (MXFP4 experts kept as MLX mxfp4),
deepseek2 (-> deepseek_v3: MLA in llama.cpp's k_b / v_b form, dense leading layers, shared experts), glm4moe (its
MTP block, nextn, left out), dots1, minimax-m2 (-> minimax), granitemoe, ernie4_5-moe (without exp_probs_b),
llama4, and the gated DeltaNet hybrids qwen3next (-> qwen3_next) and qwen35moe (-> qwen3_5_moe), whose DeltaNet
tensors llama.cpp's converter rearranges (undone by gguf_deltanet.py), and hunyuan-moe (-> mlx_flash.models'
hunyuan_moe: mlx-lm's hunyuan with the top-k weights renormalised, as llama.cpp and the reference route), and
deepseek32 (-> deepseek_v32: deepseek2's tensors and the lightning indexer's).
gguf_archs.NOT_CONVERTED names the architectures refused and why.
"""

from __future__ import annotations

import json
import math
import mmap
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np
from tqdm import tqdm

from ..errors import SourceError, UnsupportedArchitectureError
from ..format import ggml
from ..format.quant import is_symmetric
from ..format.safetensors_io import DTYPES as DTYPES_ST
from ..format.safetensors_io import ShardWriter, fill_hole, hole_file
from ..format.safetensors_io import read_header as safetensors_header
from ..models.blocked import UNITS
from .gguf_archs import Meta, arch_spec, is_mtp, map_name
from .gguf_header import GGUF_MAGIC, GGUFFile, read_header
from .gguf_quants import (
    EXACT,
    GROUP_SIZE,
    REQUANT,
    STREAMED,
    UNIFORM,
    by_rows,
    dequantize,
    mixed_roles,
    repackers,
    requantize,
    role,
)
from .gguf_tokenizer import build_tokenizer, portable_tokenizer_config

DEFAULT_SHARD_BYTES = 2 << 30
MX_LOAD_MAX_BYTES = 128 << 20  # files up to this size are read whole by mx.load, larger ones a tensor at a time
# the types mx.load reads as the file holds them: it dequantises others itself, and its K-quants are not llama.cpp's
# values (a Q4_K tensor 33% off, RMS: tests/test_gguf.py), so a file holding any is read by the reader
MX_LOAD_EXACT = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0")
DTYPES = ("float16", "bfloat16", "float32")
EXPERT_TENSORS = tuple(f"ffn_{p}_exps.weight" for p in ("gate", "up", "down"))
# what gguf_to_mlx_dir(experts_in_place=True) writes beside the model: where its experts stay in the GGUF
IN_PLACE = "gguf_experts.json"
# what gguf_to_mlx_dir(ffn_holes=True) writes beside the model: where each layer's FFN is to be converted from
FFN_HOLES = "gguf_ffn.json"
# ... and the quantised modules whose biases it left out (symmetric: derived from their scales)
SYMMETRIC = "gguf_symmetric.json"
# what gguf_to_mlx_dir writes beside the model: the modules whose weights it kept as GGML blocks ({path: type})
BLOCKS = "gguf_blocks.json"
# Resident matrices kept as their GGML blocks (compute/blocks.py): the types no MLX quantisation holds exactly in as
# few bytes, in the tensors every architecture without a rearranger maps to a plain linear layer or embedding
BLOCK_TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS")
BLOCK_ROLES = ("attn_q", "attn_k", "attn_v", "attn_output", "output", "token_embd")
# GGUF architectures whose dense FFN mlx-lm computes as SwitchGLU does (a SiLU GLU), and the neurons of a unit where
# it is kept as its blocks (kept_dense): a K-quant's super-block
BLOCKED_ARCHS = ("llama", "qwen2", "qwen3")
BLOCKED_UNITS = 256


# --------------------------------------------------------------------------------------
# Tensor sources: each yields (gguf base name, part, {"weight"/"scales"/"biases"/"bias": mx.array}, quant)
# with quant = (group_size, bits) for MLX-quantised weights, else None.
# --------------------------------------------------------------------------------------

Tensor = Tuple[str, str, Dict[str, object], Optional[Tuple[int, int]]]


def _split_name(name: str) -> Tuple[str, str]:
    base, _, part = name.rpartition(".")
    if part in ("weight", "bias") and base:
        return base, part
    return name, "weight"


def _iter_mx(arrays: dict) -> Iterator[Tensor]:
    for name in sorted(arrays):
        if name.endswith((".scales", ".biases")):
            continue
        base, part = _split_name(name)
        stem = name[: -len(".weight")] if name.endswith(".weight") else name
        if f"{stem}.scales" in arrays:
            w, s, b = arrays[name], arrays[f"{stem}.scales"], arrays[f"{stem}.biases"]
            bits = w.shape[-1] // s.shape[-1]  # mx.load always uses 32-value groups for GGUF blocks
            yield base, part, {"weight": w, "scales": s, "biases": b}, (GROUP_SIZE, bits)
        else:
            yield base, part, {part: arrays[name]}, None


def _iter_reader(reader, path: Path, skip=frozenset(), blocks: bool = False) -> Iterator[Tensor]:
    read = _reading(reader, path, blocks)
    for t in reader.tensors:
        if t.name in skip:
            continue
        yield read(t)
        _drop_pages(reader.data, t.data_offset, t.n_bytes)


def _reading(reader, path: Path, blocks: bool = False):
    """A function reading a header entry of `reader` (GGUFFile) as its Tensor (`blocks`: `kept_as_blocks` ones as
    their GGML blocks)."""
    import gguf

    T = gguf.GGMLQuantizationType
    repack = {mixed: repackers(mixed) for mixed in (False, True)}
    mixed = mixed_roles(reader.tensors)
    return lambda t: _read_tensor(t, T, repack[role(t.name) in mixed], path, blocks)


def kept_experts(header) -> dict:
    """{tensor name: header entry} of the stacked experts (ffn_{gate,up,down}_exps) read in place as their GGML
    blocks (format/ggml.py): all of the file's, where every one is of a type with kernels; else none (they are then
    converted as every other tensor)."""
    exps = [t for t in header.tensors if t.name.endswith(EXPERT_TENSORS)]
    if not exps or any(t.tensor_type.name not in ggml.BLOCKS or len(t.shape) != 3 for t in exps):
        return {}
    return {t.name: t for t in exps}


def kept_dense(header, path: Path) -> dict:
    """{tensor name: header entry} of a dense model's FFN matrices kept as blocks of BLOCKED_UNITS neurons
    (models/blocked.py: the file's blocks, as an MoE's experts): where the FFN is a SiLU GLU (BLOCKED_ARCHS, tensors
    not rearranged) of whole such blocks, every matrix of a type with kernels (ggml.BLOCKS) and one at least of a type
    MLX's affine codes do not hold in as few bytes (BLOCK_TYPES); else none (its neurons are then units, re-quantised
    where need be)."""
    meta = Meta(header.fields, path)
    arch = meta.get("general.architecture")
    if arch not in BLOCKED_ARCHS or arch_spec(arch, meta).rearranger is not None:
        return {}
    ffn = _dense_ffn(header)
    kinds = {t.tensor_type.name for t in ffn.values()}
    if not ffn or not kinds <= set(ggml.BLOCKS) or not kinds & set(BLOCK_TYPES):
        return {}
    names = {t.name for t in header.tensors}
    layers = {name.split(".")[1] for name in ffn}
    if len(ffn) != 3 * len(layers) or any(  # (a fused gate_up, or biases: not this)
        f"blk.{i}.ffn_{p}.weight" not in ffn or f"blk.{i}.ffn_{p}.bias" in names
        for i in layers
        for p in ("gate", "up", "down")
    ):
        return {}
    hidden = {int(t.shape[1]) for name, t in ffn.items() if ".ffn_down." not in name}
    return ffn if len(hidden) == 1 and hidden.pop() % BLOCKED_UNITS == 0 else {}


def blocked_experts(ffn: dict, spec) -> dict:
    """gguf.IN_PLACE's `experts` of `kept_dense`'s matrices: per BlockedMLP projection path its type, the offset of
    block 0 and shape [blocks, out, in]; a down projection's blocks are not stacked (block b of each row is a
    neuron block's row), so its entry adds the stride of its rows (`row_stride`), and is copied."""
    out = {}
    for name, t in ffn.items():
        mlp, _, proj = map_name(spec, _split_name(name)[0])[0].rpartition(".")
        cols, rows = (int(x) for x in t.shape)
        kind = t.tensor_type.name
        e = {"type": kind, "offset": int(t.data_offset)}
        if ".ffn_down." in name:
            e["shape"] = [cols // BLOCKED_UNITS, rows, BLOCKED_UNITS]
            e["row_stride"] = ggml.row_bytes(kind, cols)
        else:
            e["shape"] = [rows // BLOCKED_UNITS, BLOCKED_UNITS, cols]
        out[f"{mlp}.switch_mlp.{proj}"] = e
    return out


def kept_as_blocks(t) -> bool:
    """Whether header entry `t` is a resident matrix convert keeps as its GGML blocks (BLOCK_TYPES, BLOCK_ROLES)."""
    base, part = _split_name(t.name)
    return (
        part == "weight"
        and len(t.shape) == 2
        and t.tensor_type.name in BLOCK_TYPES
        and base.rpartition(".")[2] in BLOCK_ROLES
        and int(t.shape[0]) % ggml.BLOCKS[t.tensor_type.name][0] == 0
    )


def _read_tensor(t, T, repack, path: Path, blocks: bool = False) -> Tensor:
    import mlx.core as mx

    base, part = _split_name(t.name)
    shape = tuple(int(x) for x in reversed(t.shape))
    raw = t.data
    if blocks and kept_as_blocks(t):  # its bytes as they are: uint8 [rows, row bytes]
        return base, part, {"weight": mx.array(np.asarray(raw).reshape(shape[0], -1))}, ("ggml", t.tensor_type.name)
    if t.tensor_type in repack and len(shape) in (2, 3) and part == "weight":  # 3-D: stacked experts
        w, s, b, bits = by_rows(repack[t.tensor_type], np.asarray(raw).reshape(int(np.prod(shape[:-1])), -1))
        arrays = {"weight": w, "scales": s, **({} if b is None else {"biases": b})}  # (mxfp4: no biases)
        return base, part, {k: mx.array(a.reshape(*shape[:-1], -1)) for k, a in arrays.items()}, (GROUP_SIZE, bits)
    if t.tensor_type == T.F32:
        arr = mx.array(np.asarray(raw, dtype=np.float32).reshape(shape))
    elif t.tensor_type == T.F16:
        arr = mx.array(np.asarray(raw, dtype=np.float16).reshape(shape))
    elif t.tensor_type == T.BF16:
        bits16 = np.ascontiguousarray(raw).view(np.uint16).reshape(shape)
        arr = mx.array(bits16).view(mx.bfloat16)
    elif len(shape) == 2 and part == "weight" and shape[1] % GROUP_SIZE == 0:
        return base, part, requantize(np.asarray(raw).reshape(shape[0], -1), t, path), REQUANT
    else:
        arr = mx.array(dequantize(np.asarray(raw), t, path).reshape(shape).astype(np.float16))
    return base, part, {part: arr}, None


def keeps_blocks(header, path: Path) -> bool:
    """Whether convert keeps a GGUF's `kept_as_blocks` matrices as they are: not where its architecture's tensors are
    rearranged (MLA, DeltaNet), which re-quantises them."""
    meta = Meta(header.fields, path)
    return arch_spec(meta.get("general.architecture"), meta).rearranger is None


def converted_size(t, mixed: set = frozenset(), blocks: bool = True) -> Tuple[int, Optional[Tuple[int, int]]]:
    """(bytes, (group_size, bits) or None) of header entry `t` as `_iter_reader` converts it (`mixed`: the header's
    `mixed_roles`; `blocks`: whether `kept_as_blocks` ones are, i.e. its architecture has no rearranger), from the
    header alone (convert's estimate of the disk it needs)."""
    import gguf

    T = gguf.GGMLQuantizationType
    _, part = _split_name(t.name)
    if blocks and kept_as_blocks(t):
        return int(t.n_bytes), None
    n = math.prod(int(x) for x in t.shape)
    groups = n // GROUP_SIZE
    exact = t.tensor_type.name in EXACT and not (t.tensor_type.name in UNIFORM and role(t.name) in mixed)
    if exact and len(t.shape) in (2, 3) and part == "weight":
        bits, table = EXACT[t.tensor_type.name]
        return n * bits // 8 + table * groups, (GROUP_SIZE, bits)
    if t.tensor_type in (T.F32, T.F16, T.BF16):
        return int(t.n_bytes), None
    if len(t.shape) == 2 and part == "weight" and int(t.shape[0]) % GROUP_SIZE == 0:  # (GGUF order: rows last)
        return n * REQUANT[1] // 8 + 4 * (n // REQUANT[0]), REQUANT
    return 2 * n, None  # float16


def _drop_pages(data: np.ndarray, offset: int, nbytes: int) -> None:
    """Unmap a tensor's pages of the memory-mapped file once it is read: the process's resident set stays about one
    tensor (the pages stay in the page cache, and are read again if touched)."""
    m = getattr(data, "_mmap", None)
    if m is None or not hasattr(m, "madvise") or getattr(data, "offset", 0) != 0:
        return
    start = offset // mmap.PAGESIZE * mmap.PAGESIZE
    m.madvise(mmap.MADV_DONTNEED, start, min(offset + nbytes, len(m)) - start)


# --------------------------------------------------------------------------------------
# Conversion
# --------------------------------------------------------------------------------------


def _check_file(path: Path) -> None:
    if not path.exists():
        raise SourceError(f"{path}: no such GGUF file")
    if not path.is_file():
        raise SourceError(f"{path}: not a file (expected a .gguf file)")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise SourceError(f"{path}: cannot be read ({e})") from e
    if len(magic) < 4:
        raise SourceError(f"{path}: not a GGUF file (only {len(magic)} bytes long)")
    if magic != GGUF_MAGIC:
        raise SourceError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")


class _MxSource:
    """Whole file through mx.load: fast, but every tensor is held in memory at once."""

    def __init__(self, arrays: dict, meta: dict):
        self.arrays, self.meta = arrays, meta

    def shapes(self) -> Dict[str, Tuple[int, ...]]:
        out = {}
        for base, part, arrays, quant in _iter_mx(self.arrays):
            a = arrays["weight"] if quant is not None else arrays[part]
            shape = tuple(a.shape)
            if quant is not None:
                shape = shape[:-1] + (shape[-1] * 32 // quant[1],)
            out[f"{base}.{part}"] = shape
        return out

    def tensors(self, skip=frozenset(), blocks: bool = False) -> Iterator[Tensor]:
        return (t for t in _iter_mx(self.arrays) if f"{t[0]}.{t[1]}" not in skip)  # (no types kept as blocks)

    def sizes(self) -> Dict[str, int]:
        return {
            f"{base}.{part}": sum(a.nbytes for a in arrays.values()) for base, part, arrays, _ in _iter_mx(self.arrays)
        }


class _ReaderSource:
    """File memory-mapped (GGUFFile): any tensor type, one tensor in memory at a time."""

    def __init__(self, reader, meta: dict):
        self.reader, self.meta = reader, meta

    def shapes(self) -> Dict[str, Tuple[int, ...]]:
        out = {}
        for t in self.reader.tensors:
            base, part = _split_name(t.name)
            out[f"{base}.{part}"] = tuple(int(x) for x in reversed(t.shape))
        return out

    def tensors(self, skip=frozenset(), blocks: bool = False) -> Iterator[Tensor]:
        return _iter_reader(self.reader, self.meta.path, skip, blocks)

    def sizes(self) -> Dict[str, int]:
        """Bytes of each tensor in the file."""
        return {"%s.%s" % _split_name(t.name): int(t.n_bytes) for t in self.reader.tensors}


def _tensor_count(path: Path) -> int:
    """The tensor count of a GGUF's header (magic, version, then the count as uint64)."""
    with open(path, "rb") as f:
        f.seek(8)
        return int.from_bytes(f.read(8), "little")


def _open(path: Path, force_reader: bool, mx_load_max_bytes: int, reader: Optional[GGUFFile] = None):
    """mx.load for files up to `mx_load_max_bytes` whose tensors it can all read, else `reader` (read_header's).

    Damaged files -> SourceError, before mx.load sees them.
    """
    if reader is None:
        reader = read_header(path)
    meta = Meta(reader.fields, path)
    exact = all(t.tensor_type.name in MX_LOAD_EXACT for t in reader.tensors)
    if not force_reader and exact and path.stat().st_size <= mx_load_max_bytes:
        import mlx.core as mx

        try:
            arrays = mx.load(str(path), format="gguf")
            loaded = sum(not k.endswith((".scales", ".biases")) for k in arrays)
            if loaded == len(reader.tensors):  # (mx.load stops at a type it cannot read, e.g. MXFP4, and says nothing)
                return _MxSource(arrays, meta)
        except Exception:  # a tensor type mx.load cannot read (the reader reads them all)
            pass
    return _ReaderSource(reader, meta)


def _unpermute(a, n_head: int):
    """Undo llama.cpp's RoPE row permutation on the rows (axis 0) of `a`."""
    rows = a.shape[0]
    if rows % (2 * n_head):
        raise SourceError(f"cannot unpermute {rows} rows over {n_head} heads")
    return a.reshape(n_head, rows // n_head // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


def _clear_old_outputs(out_dir: Path) -> None:
    for pattern in (
        "model*.safetensors",
        ".tmp-model-*.safetensors",
        ".tmp-model-*.spool",
        ".tmp-ffn-*.safetensors",
        "model.safetensors.index.json",
    ):
        for f in out_dir.glob(pattern):
            f.unlink()


def _dense_ffn(header) -> dict:
    """{name: header entry} of a dense model's FFN matrices (none for a mixture of experts)."""
    if any(t.name.endswith(EXPERT_TENSORS) for t in header.tensors):
        return {}
    return {
        t.name: t
        for t in header.tensors
        if t.name.startswith("blk.")
        and t.name.endswith(".weight")
        and STREAMED.search(t.name[: -len(".weight")])
        and len(t.shape) == 2
    }


def _write_holes(writer, out_dir: Path, holes: dict, header, path, spec, quant_of, cast, unpermute: bool) -> dict:
    """A shard per layer of `holes` (_dense_ffn) whose data are not written: each tensor's arrays as its first row
    converts, with all its rows. Returns {shard: {"tensors": GGUF names, "names": mlx-lm names}}."""
    read = _reading(header, path)
    meta = Meta(header.fields, path)
    layers: Dict[int, list] = {}
    for t in holes.values():
        layers.setdefault(int(t.name.split(".")[1]), []).append(t)
    shards = {}
    for i, tensors in sorted(layers.items()):
        entries = _HoleEntries()
        for t in tensors:
            entries.rows = t.shape[1]  # (GGUF order: rows last)
            row = replace(t, shape=(t.shape[0], 1), n_bytes=t.n_bytes // t.shape[1])
            _write_tensor(entries, spec, meta, *read(row), quant_of, cast, unpermute)
        f = out_dir / f".tmp-ffn-{i:05d}.safetensors"
        hole_file(f, entries.sizes, {"format": "mlx"})
        writer.add_file(f, list(entries.sizes))
        shards[f] = {"tensors": [t.name for t in tensors], "names": list(entries.sizes)}
    return shards


class _HoleEntries:
    """A writer (ShardWriter.add) noting {name: (dtype, shape, bytes)} of arrays converted from a tensor's first
    row, as the tensor's `rows` make them."""

    def __init__(self):
        self.sizes, self.rows = {}, 1

    def add(self, name: str, arr, group=None) -> None:
        self.sizes[name] = (DTYPES_ST[arr.dtype], [self.rows, *arr.shape[1:]], arr.nbytes // arr.shape[0] * self.rows)


class FFNHoles:
    """The dense FFN of a GGUF's mlx-lm directory written with `ffn_holes`: each layer's shard is a header over a
    hole until `fill` converts the layer's tensors into it (when convert reaches the layer) and unlinks it: MLX
    reads it through the descriptor its arrays hold, and the disk space goes with them. The disk never holds the
    converted FFN whole."""

    def __init__(self, model_dir: Path):
        self.dir = Path(model_dir)
        self.record = json.loads((self.dir / FFN_HOLES).read_text())
        self.path = Path(self.record["file"])
        self._read = None

    @classmethod
    def open(cls, model_dir) -> Optional["FFNHoles"]:
        """The directory's holes, or None if it has none."""
        return cls(model_dir) if (Path(model_dir) / FFN_HOLES).is_file() else None

    @property
    def files(self) -> List[str]:
        """The shards not filled yet."""
        return list(self.record["shards"])

    def fill(self, prefix: str) -> None:
        """Convert the tensors of the shards holding `prefix`.* (a layer's mlp) into them; SourceError if the GGUF
        changed since the directory was written."""
        import mlx.core as mx

        if self._read is None:
            st = self.path.stat() if self.path.is_file() else None
            if st is None or (st.st_size, st.st_mtime_ns) != (self.record["bytes"], self.record["mtime_ns"]):
                raise SourceError(f"{self.path}: moved or changed while it was being converted")
            self.header = read_header(self.path)
            self.meta = Meta(self.header.fields, self.path)
            self.spec = arch_spec(self.meta["general.architecture"], self.meta)
            self._read = _reading(self.header, self.path)
        by_name = {t.name: t for t in self.header.tensors}
        cast = getattr(mx, self.record["dtype"]) if self.record["dtype"] else None
        for shard, entry in list(self.record["shards"].items()):
            if not any(n.startswith(prefix + ".") for n in entry["names"]):
                continue
            path = self.dir / shard
            filler = _Filler(path)
            for name in entry["tensors"]:
                t = by_name[name]
                _write_tensor(filler, self.spec, self.meta, *self._read(t), {}, cast, self.record["unpermute"])
                _drop_pages(self.header.data, t.data_offset, t.n_bytes)
            filler.close()
            path.unlink()
            del self.record["shards"][shard]


class _Filler:
    """A writer (ShardWriter.add) of arrays into the hole of their shard (`fill_hole`)."""

    def __init__(self, path: Path):
        self.header, self.f = safetensors_header(path), open(path, "r+b")
        self.left = set(self.header) - {"__metadata__"}

    def add(self, name: str, arr, group=None) -> None:
        fill_hole(self.f, self.header, name, arr)
        self.left.discard(name)

    def close(self) -> None:
        self.f.close()
        if self.left:
            raise ValueError(f"{sorted(self.left)} not converted")


def _write_tensor(
    writer,
    spec,
    meta,
    base: str,
    part: str,
    arrays: dict,
    quant,
    quant_of: dict,
    cast,
    unpermute: bool,
    by_layer=False,
    symmetric: Optional[set] = None,
):
    """One tensor under its mlx-lm name: RoPE rows unpermuted, norms unshifted, cast; its quantisation noted.
    `by_layer`: shards per GGUF block (its FFN apart from the rest), any other array alone (ShardWriter's groups).
    `symmetric`: biases that are -2^(bits-1) times the scales (Q4_0, Q8_0) left out, the name noted there
    (load_source_model derives them)."""
    import mlx.core as mx

    hf, head_key = map_name(spec, base)
    arch = meta["general.architecture"]
    if head_key is not None and unpermute:
        n_head = meta.int(f"{arch}.{head_key}", meta.int(f"{arch}.attention.head_count"))
        arrays = {k: _unpermute(v, n_head) for k, v in arrays.items()}
    if base.rpartition(".")[2] in spec.row_vectors:
        arrays = {k: v.reshape(1, -1) for k, v in arrays.items()}
    if spec.norm_shift and base.endswith("norm"):
        arrays = {k: v - spec.norm_shift for k, v in arrays.items()}
    if cast is not None:
        arrays = {k: v.astype(cast) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in arrays.items()}
    if quant is not None and quant[0] == "ggml":  # GGML blocks as they are
        quant_of[hf] = quant
    elif quant is not None:  # uint8 scales: mxfp4 (as mlx-lm infers it)
        quant_of[hf] = (*quant, "mxfp4" if arrays["scales"].dtype == mx.uint8 else "affine")
        if symmetric is not None and "biases" in arrays and is_symmetric(arrays["biases"], arrays["scales"], quant[1]):
            symmetric.add(hf)
            arrays = {k: v for k, v in arrays.items() if k != "biases"}
    block = base.split(".")[1] if base.startswith("blk.") else None
    part = "ffn" if block is not None and STREAMED.search(base) else "rest"
    for key, arr in arrays.items():
        name = hf if base.rpartition(".")[2] in spec.bare else f"{hf}.{key}"
        writer.add(name, arr, (block or name, part) if by_layer else None)


def gguf_to_mlx_dir(
    gguf_path,
    out_dir,
    *,
    dtype: Optional[str] = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: bool = False,
    _unpermute_qk: bool = True,
    _force_reader: bool = False,
    experts_in_place: bool = False,
    by_layer: bool = False,
    ffn_holes: bool = False,
) -> Path:
    """Convert a GGUF file into an mlx-lm model directory at `out_dir` and return its path.

    `dtype` ("float16", "bfloat16", "float32") casts every float tensor (scales and biases of
    quantised weights, norms, unquantised weights); by default they keep the GGUF's dtypes and
    re-quantised tensors (see the module docstring) have float16 scales. Weights are written in shards of about
    `shard_bytes` (one `model.safetensors` when they fit), a tensor at a time: memory holds about one tensor
    whatever the file's size. `progress`: a bar of the bytes read. Files in `out_dir` other than the
    ones written here are left alone, except older `model*.safetensors` shards, which are removed.

    Raises SourceError for a missing / non-GGUF / damaged file or unreadable metadata, and
    UnsupportedArchitectureError for architectures (or architecture variants) without a mapping.
    `experts_in_place`: a mixture of experts' stacked experts of GGML block types (`kept_experts`) are not
    written: IN_PLACE records where each lies in the GGUF (file, size, time; per mlx-lm projection path its type,
    offset and shape [experts, out, in]) and the model loads without them (convert reads them in place); so too
    a dense FFN `kept_dense` keeps as blocks of neurons (the config's models.blocked.UNITS: its model's FFNs are
    such experts).
    `by_layer`: shards per layer (its FFN and the rest apart; any tensor outside the layers alone), each written
    once, so that convert frees each as soon as it has read it, and symmetric biases left out (SYMMETRIC, derived
    again by load_source_model).
    `ffn_holes`: a dense model's FFN matrices are not converted yet: each layer's are a shard of a header over a
    hole (a sparse file), filled when convert reaches the layer (FFNHoles).
    `_unpermute_qk=False` and `_force_reader=True` are for tests only.
    """
    import mlx.core as mx

    path = Path(gguf_path).expanduser()
    out_dir = Path(out_dir).expanduser()
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    cast = getattr(mx, dtype) if dtype is not None else None
    _check_file(path)
    header = read_header(path)  # (a damaged one ends here, in one line)
    if progress:
        print(
            f"{path.name}: reading the header and tokenizer ({path.stat().st_size / 2**30:.2f} GiB file)",
            file=sys.stderr,
            flush=True,
        )
    # Small files: mx.load (fast, holds everything). Others: the reader's memory map, a tensor at a time.
    source = _open(path, _force_reader, MX_LOAD_MAX_BYTES, header)
    meta = source.meta
    arch = meta.get("general.architecture")
    spec = arch_spec(arch, meta)

    shapes = source.shapes()
    unknown = []
    for name in list(shapes):
        base, _ = _split_name(name)
        if is_mtp(spec, meta, base):
            del shapes[name]
            continue
        if base in spec.rejected:
            raise UnsupportedArchitectureError(f"{path}: {spec.rejected[base]}")
        if map_name(spec, base)[0] is None:
            unknown.append(name)
    if unknown:
        raise UnsupportedArchitectureError(
            f"{path}: {len(unknown)} tensor(s) with no mapping for GGUF architecture {arch!r}: "
            f"{', '.join(sorted(unknown)[:8])}"
        )
    if "token_embd.weight" not in shapes:
        raise SourceError(f"{path}: no token_embd.weight tensor")
    config = spec.make_config(meta, shapes, spec)
    tokenizer = build_tokenizer(meta)
    dense = kept_dense(header, path) if experts_in_place else {}
    if dense:
        config[UNITS] = BLOCKED_UNITS

    out_dir.mkdir(parents=True, exist_ok=True)
    _clear_old_outputs(out_dir)
    writer = ShardWriter(out_dir, shard_bytes)
    quant_of: Dict[str, Tuple[int, int]] = {}
    sizes = source.sizes()
    bar = tqdm(
        total=sum(sizes.values()),
        desc=f"read {path.name}",
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        disable=not progress,
    )
    rearrange = spec.rearranger(meta) if spec.rearranger is not None else None
    kept = kept_experts(header) if experts_in_place else {}
    kept = {k: t for k, t in kept.items() if not is_mtp(spec, meta, _split_name(k)[0])}
    (out_dir / IN_PLACE).unlink(missing_ok=True)
    if kept or dense:
        st = path.stat()
        experts = {
            map_name(spec, _split_name(k)[0])[0]: {
                "type": t.tensor_type.name,
                "offset": int(t.data_offset),
                "shape": [int(x) for x in reversed(t.shape)],
            }
            for k, t in kept.items()
        }
        experts.update(blocked_experts(dense, spec))
        kept = {**kept, **dense}
        record = {"file": str(path.resolve()), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "experts": experts}
        with open(out_dir / IN_PLACE, "w") as f:
            json.dump(record, f)
        bar.update(sum(int(t.n_bytes) for t in kept.values()))
    holes = _dense_ffn(header) if ffn_holes and rearrange is None and not dense else {}
    symmetric = set() if by_layer else None
    for f in (FFN_HOLES, SYMMETRIC, BLOCKS):
        (out_dir / f).unlink(missing_ok=True)
    for tensor in source.tensors(skip=set(kept) | set(holes), blocks=rearrange is None):  # (as keeps_blocks)
        bar.update(sizes[f"{tensor[0]}.{tensor[1]}"])
        if is_mtp(spec, meta, tensor[0]):
            continue
        for base, part, arrays, quant in rearrange(*tensor) if rearrange is not None else [tensor]:
            _write_tensor(
                writer, spec, meta, base, part, arrays, quant, quant_of, cast, _unpermute_qk, by_layer, symmetric
            )
    if rearrange is not None:
        rearrange.finish()
    shards = _write_holes(writer, out_dir, holes, header, path, spec, quant_of, cast, _unpermute_qk)
    final = dict(zip(writer.files, writer.close()))
    bar.close()
    if symmetric:
        (out_dir / SYMMETRIC).write_text(json.dumps(sorted(symmetric)))
    blocks = {hf: q[1] for hf, q in quant_of.items() if q[0] == "ggml"}
    quant_of = {hf: q for hf, q in quant_of.items() if hf not in blocks}
    if blocks:
        (out_dir / BLOCKS).write_text(json.dumps(blocks))
    if holes:
        st = path.stat()
        record = {"file": str(path.resolve()), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "dtype": dtype}
        record["unpermute"] = _unpermute_qk
        record["shards"] = {final[f].name: entry for f, entry in shards.items()}
        with open(out_dir / FFN_HOLES, "w") as f:
            json.dump(record, f)

    if quant_of:

        def entry(q):
            return {"group_size": q[0], "bits": q[1], **({"mode": q[2]} if q[2] != "affine" else {})}

        common, _ = Counter(quant_of.values()).most_common(1)[0]
        quantization = entry(common)
        for hf, q in sorted(quant_of.items()):
            if q != common:
                quantization[hf] = entry(q)
        config["quantization"] = quantization
        config["quantization_config"] = dict(quantization)

    for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        if f"tokenizer.ggml.{name}_token_id" in meta:
            config[key] = int(meta[f"tokenizer.ggml.{name}_token_id"])
    with open(out_dir / "config.json", "w") as f:
        json.dump(dict(sorted(config.items())), f, indent=2)
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    with open(out_dir / "generation_config.json", "w") as f:
        json.dump(gen, f, indent=2)
    tokenizer.save_pretrained(str(out_dir))
    # without indentation: the GGUF keeps its vocabulary compactly, and pretty-printed it took 2.3x the bytes
    # (written here, not by `tokenizers`, whose errors lose the OSError: a full disk is ENOSPC, as for every file)
    (out_dir / "tokenizer.json").write_text(tokenizer.backend_tokenizer.to_str(pretty=False), encoding="utf-8")
    portable_tokenizer_config(out_dir, tokenizer)
    return out_dir
