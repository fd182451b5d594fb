"""The flash directory, format v1-v5: the one module that reads and writes it.

    <dir>/config.json           model config (mlx-lm / Hugging Face style)
    <dir>/tokenizer*            tokenizer files
    <dir>/flash.json            manifest (this module's schema, versioned)
    <dir>/resident.safetensors  every weight that is not an FFN bundle
    <dir>/ffn.bin               all bundles, layer after layer

A bundle holds one neuron's FFN weights contiguously, as rows of "components"
(e.g. gate.weight, up.weight, down.weight for SwiGLU; fc1.weight, fc2.weight
for ReLU; quantised matrices add .scales/.biases). The manifest lists the components with their
dtype, per-neuron shape and byte offset inside the bundle, so a reader can
view any bundle (or a cache row holding one) as arrays without copying.

Each layer's region starts at a multiple of `alignment` (O_DIRECT's rule, flash pages); inside it
bundles are `stride` bytes apart, a multiple of `unit_alignment`. Format v3 packs them
(unit_alignment 16: no padding is read with them; the reader reads a run of units, or a scattered
one, as the aligned superset of its pages); v1/v2 pad every bundle to the alignment.

Format v2 adds encoded components: a component with an "encoding" entry is stored
on flash in that encoding (only "bitmap": ENDOR rows of a pruned matrix, see
bitmap.py) at its "disk_offset", and the layout's "disk_stride" is the unit's
size on flash. The cache row layout (offsets, "stride") stays dense: a reader
expands each unit read (`BundleLayout.expand`) before using it. Directories
without encoded components are written as v1, so older readers still open them.

Format v4 leaves out of resident.safetensors the biases of quantised modules whose codes are symmetric
(llama.cpp's Q4_0 / Q8_0: bias = -2^(bits-1) x scale, as the source stores none): the manifest's
resident.symmetric lists them ({module path: bits}); the model's layers derive them as they compute,
so they take neither disk, device reads nor DRAM.

Format v5 reads units in place from the model's source files instead of ffn.bin (which it has not): the manifest's
"sources" names them ({"root": the source directory, "files": [{"name" relative to it, "bytes", "mtime_ns"}]}), and
each region an "extents" entry per component of its layout ({"component", "file": index, "offset" of unit 0's
window, "stride" between units, "bytes" of a window, "at": the component's offset in it}): the windows tile a
unit's cache row in order, each an aligned window around its component where the source's strides allow (read
straight into the row; the component "at" bytes into it, this layer's own offset: `layout_of`), else exactly its
bytes (at 0: the region's layout). A source file moved, cut or changed since convert is refused at open. A GGUF's
experts copied (`convert --copy`) are its tensors as they are in the directory's own ffn.bin, read the same way:
root "." (the directory; only their sizes are checked at open, as a copy of the directory changes their times).
Format v5 also keeps a K-quant or i-quant GGUF's resident matrices as its GGML blocks (attention projections, LM
head, token embedding: compute/blocks.py): resident.blocks names them ({module path: type}), each weight uint8
[rows, row bytes] in resident.safetensors.
"""

import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional

import mlx.core as mx
import numpy as np
from tqdm import tqdm

from ..errors import FlashFormatError, ReadError, SourceFileError
from ..io.checks import crc32_at
from ..io.reader import open_reader
from ..io.sources import SourceReader
from . import ggml, manifest
from .config import UNITS, layer_count
from .layout import DTYPES, PACKED_UNIT_ALIGNMENT, BundleLayout, Encoding, Region, is_count, round_up
from .quant import block_dequantize, is_symmetric, symmetric_biases
from .safetensors_io import TensorSpool, file_sha256

# MLX's ops over a dense FFN's blocks of neurons (every one chosen each token): as many a call as an MoE's token's
# experts, so the workspace holds what an MoE's does; a layer's are then a few calls
DENSE_CALL_EXPERTS = 8

FORMAT_NAME = "mlx_flash"
FORMAT_VERSION = 4  # v4: symmetric resident biases left out; v3: packed units; v2: encoded components; v1 (none)
VERSIONS = (1, 2, 3, 4, 5)  # v5: units in place in the source's files
MANIFEST = "flash.json"
RESIDENT = "resident.safetensors"
FFN = "ffn.bin"
PREDICTORS = "predictors.safetensors"
UNIT_CHECKSUMS = "units.crc32"  # each unit's zlib CRC-32 on flash, uint32 little-endian, in file order
DEFAULT_ALIGNMENT = 4096
PACK_BYTES = 32 << 20  # FlashWriter packs a layer's units this many bytes at a time


_SAFETENSORS_DTYPES = {
    "F16": mx.float16,
    "BF16": mx.bfloat16,
    "F32": mx.float32,
    "U32": mx.uint32,
    "I32": mx.int32,
    "U8": mx.uint8,
    "I8": mx.int8,
    "U16": mx.uint16,
    "I16": mx.int16,
    "I64": mx.int64,
    "U64": mx.uint64,
    "BOOL": mx.bool_,
}


@dataclass(frozen=True)
class ResidentTensor:
    """One tensor of resident.safetensors: absolute file offset, size, dtype and shape."""

    name: str
    offset: int
    nbytes: int
    dtype: mx.Dtype
    shape: tuple

    def loaded_dtype(self, cast=None) -> mx.Dtype:
        """The dtype in memory when `cast(name) -> dtype name or None` casts float tensors on load."""
        target = cast(self.name) if cast and mx.issubdtype(self.dtype, mx.floating) else None
        return DTYPES[target] if target else self.dtype

    def nbytes_as(self, cast=None) -> int:
        """Bytes in memory under `cast` (see `loaded_dtype`)."""
        return self.nbytes // self.dtype.size * self.loaded_dtype(cast).size


class FlashDir:
    """A flash directory opened for reading: manifest checked, files present, sizes right.

    Checksums are only verified by `verify()` (reading everything is too slow for a load).
    """

    def __init__(self, path):
        self.path = Path(path)
        self._call_bytes = {}
        if not self.path.is_dir():
            raise FlashFormatError(
                f"{self.path}: not a directory (expected a flash directory made by mlx_flash.convert)"
            )
        self.manifest = self._read_manifest()
        m = self.manifest
        try:
            manifest.check_types(m)
            self.alignment = int(m["alignment"])
            self.unit_alignment = int(m.get("unit_alignment", self.alignment))  # v1/v2: units padded to the alignment
            self.layouts: Dict[str, BundleLayout] = {k: BundleLayout.from_json(v) for k, v in m["layouts"].items()}
            manifest.check_ffn(m["ffn"], self.layouts)
            if not all(is_count(a) and a > 0 and not a & (a - 1) for a in (self.alignment, self.unit_alignment)):
                raise ValueError("alignment and unit_alignment must be powers of two")
            self.layers: List[Dict[str, Region]] = manifest.read_layers(m, self.layouts)
            manifest.check_ggml_lengths(m["ffn"], self.layers, self.layouts)
            if not all(p and type(b) is int and 2 <= b <= 8 for p, b in self.symmetric.items()):
                raise ValueError(f"resident.symmetric is {self.symmetric!r}, not module paths and their bits")
            if not all(p and k in ggml.BLOCKS for p, k in self.blocks.items()):
                raise ValueError(f"resident.blocks is {self.blocks!r}, not module paths and GGML block types")
            if self.version == 1 and any(l.encoded for l in self.layouts.values()):
                raise ValueError("encoded components need format version 2")
            if self.version < 3 and self.unit_alignment != self.alignment:
                raise ValueError("packed units need format version 3")
        except FlashFormatError as e:
            raise FlashFormatError(f"{self.path / MANIFEST}: {e}") from e
        except (KeyError, TypeError, ValueError, AttributeError, ArithmeticError) as e:
            raise FlashFormatError(f"{self.path / MANIFEST}: malformed manifest ({type(e).__name__}: {e})") from e
        self.config = self._read_json("config.json")
        self._check_layer_count()
        self._check_files()
        self._resident_index = None
        self._resident_checked = False

    # -- manifest and files -------------------------------------------------
    def _read_json(self, name):
        p = self.path / name
        if not p.is_file():
            raise FlashFormatError(f"{p}: missing file")
        try:
            with open(p) as f:
                return json.load(f)
        except json.JSONDecodeError as e:
            raise FlashFormatError(f"{p}: not valid JSON ({e})") from e

    def _read_manifest(self):
        m = self._read_json(MANIFEST)
        if m.get("format") != FORMAT_NAME:
            raise FlashFormatError(f"{self.path / MANIFEST}: not an mlx_flash manifest")
        v = m.get("format_version")
        if v not in VERSIONS:
            raise FlashFormatError(
                f"{self.path / MANIFEST}: format version {v!r} is not supported "
                f"(this mlx_flash reads versions {', '.join(map(str, VERSIONS))}); re-convert the model"
            )
        self.version = v
        return m

    def _check_layer_count(self):
        """As many layers as the model has: a manifest cut short would leave layers without weights."""
        want = layer_count(self.config)
        paths = self.ffn.get("mlp_paths")
        for n, what in ((want, "the config's"), (len(paths) if paths else None, "the FFN paths'")):
            if n is not None and n != len(self.layers):
                raise FlashFormatError(
                    f"{self.path / MANIFEST}: {len(self.layers)} layers, {what} count is {n} (cut short or edited)"
                )

    def _check_files(self):
        if not (self.path / RESIDENT).is_file():
            raise FlashFormatError(f"{self.path / RESIDENT}: missing file")
        expected = self.manifest["resident"]["bytes"]
        size = (self.path / RESIDENT).stat().st_size
        if size != expected:
            raise FlashFormatError(
                f"{self.path / RESIDENT}: {size} bytes, manifest says {expected} (truncated or replaced)"
            )
        if self.sources is not None:
            if self.version < 5 or not all(r.extents for r in self.regions()):
                raise FlashFormatError(
                    f"{self.path / MANIFEST}: sources need format version 5 and every region's extents"
                )
            for name, layout in self.layouts.items():  # (a unit's cache row: whole pages, read by O_DIRECT)
                if layout.stride % self.alignment:
                    raise FlashFormatError(
                        f"{self.path / MANIFEST}: {name} units of {layout.stride} bytes, not a multiple of the "
                        f"alignment {self.alignment}"
                    )
            self._check_sources()
            return
        if not (self.path / FFN).is_file():
            raise FlashFormatError(f"{self.path / FFN}: missing file")
        size = (self.path / FFN).stat().st_size
        end = 0
        for r in sorted(self.regions(), key=lambda r: r.offset):
            if r.extents:
                raise FlashFormatError(f"{self.path / MANIFEST}: layer {r.layer} {r.name} has extents but no sources")
            if r.offset < end:
                raise FlashFormatError(f"{self.path / MANIFEST}: layer {r.layer} {r.name} overlaps another region")
            end = r.offset + r.nbytes
        for r in self.regions():
            if r.offset % self.alignment or r.stride % self.unit_alignment:
                raise FlashFormatError(
                    f"layer {r.layer} {r.name}: offset {r.offset} not aligned to {self.alignment} or stride "
                    f"{r.stride} to {self.unit_alignment}"
                )
            if r.offset + r.nbytes > size:
                raise FlashFormatError(
                    f"{self.path / FFN}: truncated: layer {r.layer} ends at byte {r.offset + r.nbytes}, file has {size}"
                )

    def _check_sources(self):
        """Every source file where convert found it, as it was: its size and modification time recorded then."""
        own = not Path(self.sources["root"]).is_absolute()  # (convert --copy: its own ffn.bin, moved with it)
        for f, path in zip(self.sources["files"], self.unit_paths):
            try:
                st = path.stat()
            except OSError:
                raise SourceFileError(
                    f"{path}: missing. {self.path.name} reads its experts in place from this file: put it back, or "
                    "convert the model again from where it is now"
                ) from None
            if st.st_size != f["bytes"] or (st.st_mtime_ns != f["mtime_ns"] and not own):
                what = f"{st.st_size} bytes, {f['bytes']} at convert" if st.st_size != f["bytes"] else "modified"
                raise SourceFileError(
                    f"{path}: changed since {self.path.name} was converted ({what}); its experts are read in place "
                    "from this file: convert the model again"
                )

    # -- properties ----------------------------------------------------------
    def regions(self) -> Iterable[Region]:
        """Every region of every layer, in file order."""
        return [r for regions in self.layers for r in regions.values()]

    @property
    def ffn_path(self) -> Path:
        return self.path / FFN

    @property
    def sources(self) -> Optional[dict]:
        """The source files units are read from in place (format v5), or None: ffn.bin."""
        return self.manifest.get("sources")

    @property
    def unit_paths(self) -> List[Path]:
        """The files units are read from: the source's (in place) or ffn.bin."""
        if self.sources is None:
            return [self.ffn_path]
        return [self.path / self.sources["root"] / f["name"] for f in self.sources["files"]]  # (root: absolute or ".")

    @property
    def strides(self) -> Dict[str, int]:
        """Bytes of a cache row of each region's units."""
        return {k: v.stride for k, v in self.layouts.items()}

    def call_bytes(self, name: str) -> int:
        """A unit of region `name` in a call of MLX's ops: its rows gathered, and MLX's temporaries repacking or
        dequantising its matrices of GGML blocks (ggml.TEMPORARY_BYTES; the most any layer's types take)."""
        if name in self._call_bytes:
            return self._call_bytes[name]
        quant = self.ffn.get("quantization") or {}
        blocks = {n: ggml.layer_kinds(q, self.ffn["switch_paths"]) for n, q in quant.items() if q and "ggml" in q}
        temporaries = 0
        for i, regions in enumerate(self.layers):
            if name in regions and blocks:
                c = {c.name: c for c in self.layout_of(i, name).components}
                t = sum(ggml.temporary_bytes(k[str(i)], c[f"{n}.weight"].nbytes) for n, k in blocks.items())
                temporaries = max(temporaries, t)
        self._call_bytes[name] = self.layouts[name].stride + temporaries
        return self._call_bytes[name]

    def layout_of(self, layer: int, name: str) -> BundleLayout:
        """How a layer's units of region `name` lie in their rows: the region's layout, its components where this
        layer's are in place (Region.layout_over)."""
        return self.layers[layer][name].layout_over(self.layouts[name])

    @property
    def largest_unit_path(self) -> Path:
        """The largest file units are read from: where the disk's rate is measured."""
        return max(self.unit_paths, key=lambda p: p.stat().st_size)

    def open_units(self, **kw):
        """A reader of the units (io/reader.py's `open_reader` arguments): ffn.bin's, or the source files'."""
        return open_reader(self.ffn_path, **kw) if self.sources is None else SourceReader(self.unit_paths, **kw)

    @property
    def architecture(self) -> str:
        return self.manifest["architecture"]

    @property
    def ffn(self) -> dict:
        """FFN description: kind, activation, layout, per-matrix quantisation (see architectures.py)."""
        return self.manifest["ffn"]

    @property
    def experts_per_token(self) -> Optional[int]:
        """An MoE model's experts a token (recorded by convert; the config's num_experts_per_tok for directories
        converted before), None for a dense model."""
        if self.ffn.get("kind") != "moe":
            return None
        return self.ffn.get("experts_per_token") or self.config.get("num_experts_per_tok")

    @property
    def experts_per_call(self) -> Optional[int]:
        """The experts MLX's ops gather for a call at least: a token's; a dense FFN's blocks of neurons (every one
        a token's: models/blocked.py) DENSE_CALL_EXPERTS at most, the rest in turns."""
        k = self.experts_per_token
        return min(k, DENSE_CALL_EXPERTS) if k and UNITS in self.config else k

    @property
    def resident_bytes(self) -> int:
        return self.manifest["resident"]["bytes"]

    def resident_index(self) -> Dict[str, "ResidentTensor"]:
        """Where each resident tensor lies in resident.safetensors (absolute byte offsets), from its header.

        What streaming below the resident floor reads tensors (or rows of them) with. Parsed once."""
        if self._resident_index is None:
            self._resident_index = self._read_resident_index()
        return self._resident_index

    def _read_resident_index(self) -> Dict[str, "ResidentTensor"]:
        path = self.path / RESIDENT
        try:
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                if n > self.resident_bytes - 8:
                    raise ValueError(f"header length {n} exceeds the file")
                header = json.loads(f.read(n))
            start = 8 + n
            index = {
                name: ResidentTensor(
                    name,
                    start + t["data_offsets"][0],
                    t["data_offsets"][1] - t["data_offsets"][0],
                    _SAFETENSORS_DTYPES[t["dtype"]],
                    tuple(t["shape"]),
                )
                for name, t in header.items()
                if name != "__metadata__"
            }
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise FlashFormatError(f"{path}: unreadable safetensors header ({type(e).__name__}: {e})") from e
        for t in index.values():
            if t.offset + t.nbytes > self.resident_bytes or t.nbytes != int(np.prod(t.shape)) * t.dtype.size:
                raise FlashFormatError(f"{path}: tensor {t.name} has inconsistent offsets in the header")
        return index

    def resident_nbytes(self, cast=None) -> int:
        """Bytes of the resident weights in memory; `cast(name) -> dtype name or None` says which float
        tensors are cast to which dtype on load."""
        return sum(t.nbytes_as(cast) for t in self.resident_index().values())

    @property
    def model_bytes(self) -> int:
        """Bytes of the model's weights: resident as stored + FFN unit data without padding
        (encoded units counted dense, as the caches hold them).

        What budgets given as a percentage ("50%") are a percentage of."""
        return self.resident_bytes + sum(r.n_units * self.layouts[r.name].nbytes for r in self.regions())

    @property
    def ffn_bytes(self) -> int:
        return sum(r.nbytes for r in self.regions())

    # -- data ------------------------------------------------------------------
    @property
    def symmetric(self) -> Dict[str, int]:
        """Quantised resident modules stored without biases (symmetric codes): {module path: bits}."""
        return self.manifest["resident"].get("symmetric") or {}

    @property
    def blocks(self) -> Dict[str, str]:
        """Resident modules holding their weight as GGML blocks (compute/blocks.py): {module path: type}."""
        return self.manifest["resident"].get("blocks") or {}

    def load_resident(self, biases: bool = True) -> Dict[str, mx.array]:
        """The resident weights as mlx-lm names them; biases=False leaves out the symmetric modules' biases
        (the runtime's layers derive them: `symmetric`)."""
        self.check_resident()
        try:
            arrays = mx.load(str(self.path / RESIDENT))
        except Exception as e:
            raise FlashFormatError(f"{self.path / RESIDENT}: cannot be read ({e})") from e
        missing = [p for p in self.symmetric if f"{p}.scales" not in arrays or f"{p}.biases" in arrays]
        if missing:
            raise FlashFormatError(f"{self.path / MANIFEST}: resident.symmetric names {missing[0]}, no such module")
        if biases:
            arrays.update(
                {f"{p}.biases": symmetric_biases(arrays[f"{p}.scales"], b) for p, b in self.symmetric.items()}
            )
        return arrays

    def check_resident(self) -> None:
        """Raise FlashFormatError unless resident.safetensors hashes to the manifest's sha256 (once per FlashDir):
        every load reads it, so a corrupted byte there is found before anything computes with it."""
        if not self._resident_checked:
            if file_sha256(self.path / RESIDENT) != self.manifest["resident"]["sha256"]:
                raise FlashFormatError(f"{self.path / RESIDENT}: checksum mismatch (corrupted); re-convert the model")
            self._resident_checked = True

    def unit_checksums(self) -> Optional[Dict[tuple, np.ndarray]]:
        """{(layer, region name): each unit's CRC-32 as convert wrote it (uint32 [n_units])}, or None for a directory
        converted before units had checksums."""
        info = self.manifest.get("unit_checksums")
        if info is None:
            return None
        path = self.path / info["file"]
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise FlashFormatError(f"{path}: cannot be read ({e.strerror})") from e
        regions = self.regions()
        if len(raw) != 4 * sum(r.n_units for r in regions) or zlib.crc32(raw) != info["crc32"]:
            raise FlashFormatError(f"{path}: checksum mismatch or wrong size (corrupted); re-convert the model")
        crcs = np.frombuffer(raw, dtype="<u4")
        starts = np.cumsum([0] + [r.n_units for r in regions])
        return {(r.layer, r.name): crcs[a:b] for r, a, b in zip(regions, starts[:-1], starts[1:])}

    def load_predictors(self) -> Optional[List[Dict[str, mx.array]]]:
        """Low-rank predictors per layer ({"A": [rank, d], "B": [n, rank]}), or None if not calibrated."""
        info = (self.manifest.get("sparsity") or {}).get("predictor")
        if info is None:
            return None
        path = self.path / info["file"]
        if not path.is_file():
            raise FlashFormatError(f"{path}: missing file")
        try:
            w = mx.load(str(path))
            return [{"A": w[f"{i}.A"], "B": w[f"{i}.B"]} for i in range(len(self.layers))]
        except Exception as e:
            raise FlashFormatError(f"{path}: cannot be read ({e})") from e

    def update_manifest(self, **fields) -> None:
        """Set top-level manifest fields (e.g. calibration results), atomically."""
        m = dict(self.manifest, **fields)
        _write_json_atomic(self.path / MANIFEST, m)
        self.manifest = m

    def save_predictors(self, weights: List[Dict[str, mx.array]], threshold: float, **info) -> None:
        """Write predictors.safetensors and record it (with `info`, e.g. ranks, recall) in the manifest."""
        arrays = {f"{i}.{k}": v for i, w in enumerate(weights) for k, v in w.items()}
        tmp = self.path / "predictors.tmp.safetensors"
        mx.save_safetensors(str(tmp), arrays)
        os.replace(tmp, self.path / PREDICTORS)
        sparsity = dict(self.manifest.get("sparsity") or {})
        sparsity["predictor"] = {"file": PREDICTORS, "threshold": threshold, **info}
        self.update_manifest(sparsity=sparsity)

    def read_region(self, layer: int, name: str = "neurons") -> np.ndarray:
        """All units of one layer's region as [n_units, stride] uint8 (one batch of reads)."""
        r = self.layers[layer][name]
        buf = np.zeros((r.n_units, r.stride), dtype=np.uint8)
        units = np.arange(r.n_units)
        try:  # through the reader, as every read (cached: a whole region, read once at load)
            with self.open_units(threads=1, direct=False) as reader:
                reader.read(buf, *r.requests(units, units * r.stride))
        except ReadError as e:
            raise FlashFormatError(f"{self.units_where}: cannot read layer {layer} ({e})") from e
        if zlib.crc32(buf) != r.crc32:
            raise FlashFormatError(f"{self.units_where}: checksum mismatch in layer {layer} ({name}; corrupted)")
        return buf

    @property
    def units_where(self) -> str:
        """Where the units are, for messages."""
        return str(self.ffn_path) if self.sources is None else f"the source files in {self.unit_paths[0].parent}"

    def unpack_layer(self, layer: int) -> Dict[str, mx.array]:
        """Every component array of one layer, read from disk (e.g. for an all-resident model), expanded."""
        arrays = {}
        for name in self.layouts:
            layout = self.layout_of(layer, name)
            arrays.update(layout.unpack(layout.expand(mx.array(self.read_region(layer, name)))))
        quant = self.ffn.get("quantization") or {n: m["quantization"] for n, m in self.ffn.get("matrices", {}).items()}
        for name, q in quant.items():  # symmetric rows store no biases: the consumers get them
            if q is not None and q.get("symmetric") and f"{name}.scales" in arrays:
                arrays[f"{name}.biases"] = symmetric_biases(arrays[f"{name}.scales"], q["bits"])
            if q is not None and "ggml" in q and f"{name}.weight" in arrays:  # GGML blocks: as mlx-lm's modules hold
                kind = ggml.layer_kinds(q, self.ffn["switch_paths"])[str(layer)]  # them (quantised, or float32)
                raw = arrays.pop(f"{name}.weight")
                if kind in ggml.AFFINE:
                    parts = dict(zip(("weight", "scales", "biases"), ggml.to_affine(raw, kind)))
                    arrays.update({f"{name}.{k}": v for k, v in parts.items()})
                else:
                    arrays[f"{name}.weight"] = ggml.dequantize(raw, kind)
        return arrays

    def group_tables(self, layer: int, name: str):
        """(scales, biases or None if symmetric) [n / group_size, d] of matrix `name` stored as the source's
        codes (convert --down-bits source), from resident.safetensors."""
        tables = self.load_resident()
        prefix = f"{self.ffn['mlp_paths'][layer]}.{name}"
        return tables[f"{prefix}.scales"], tables.get(f"{prefix}.biases")

    def verify(self, progress=None) -> None:
        """Re-check sizes, alignment and checksums (each region's and each unit's); raise FlashFormatError naming the
        first bad part."""
        self.check_resident()
        units = self.unit_checksums()
        regions = progress(self.regions()) if progress else self.regions()
        for r in regions:
            rows = self.read_region(r.layer, r.name)  # (checks the region's checksum)
            if units is not None:
                bad = np.flatnonzero(r.unit_checksums(rows, np.arange(r.n_units) * r.stride) != units[r.layer, r.name])
                if len(bad):
                    raise FlashFormatError(
                        f"{self.units_where}: checksum mismatch in layer {r.layer} ({r.name} unit {bad[0]}; corrupted)"
                    )


def _write_json_atomic(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class FlashWriter:
    """Writes a flash directory into `path` (the caller picks a temporary name and renames)."""

    def __init__(
        self,
        path,
        alignment: int = DEFAULT_ALIGNMENT,
        encodings: Optional[Dict[str, Encoding]] = None,
        unit_alignment: Optional[int] = None,
        sources: Optional[dict] = None,
    ):
        """`encodings` (component name -> Encoding): store those components encoded (format v2). Regions start at
        multiples of `alignment`; units are `unit_alignment` apart (None: the alignment, every unit padded to it;
        PACKED_UNIT_ALIGNMENT: packed, format v3). `sources` (the manifest's entry, format v5): units are read in
        place from those files (add_layer_in_place), no ffn.bin is written."""
        if alignment < 512 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two >= 512, got {alignment}")
        unit_alignment = alignment if unit_alignment is None else unit_alignment
        if (
            unit_alignment < PACKED_UNIT_ALIGNMENT
            or unit_alignment & (unit_alignment - 1)
            or unit_alignment > alignment
        ):
            raise ValueError(
                f"unit alignment must be a power of two in [{PACKED_UNIT_ALIGNMENT}, {alignment}], got {unit_alignment}"
            )
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=False)
        self.alignment, self.unit_alignment = alignment, unit_alignment
        self.encodings = dict(encodings or {})
        self.layouts: Dict[str, BundleLayout] = {}
        self.layers: List[Dict[str, Region]] = []
        self.sources = sources
        self._ffn = open(self.path / FFN, "wb") if sources is None else None
        self._unit_crcs = open(self.path / UNIT_CHECKSUMS, "wb")
        self._unit_crcs_crc = 0

    def add_layer(self, regions: Dict[str, Dict[str, mx.array]]) -> None:
        """Append one layer: region name -> {component name -> [n_units, ...]}.

        Encoded units are expanded again and checked against the dense bundle (lossless)."""
        layer = {}
        for name, arrays in regions.items():
            enc = {k: e for k, e in self.encodings.items() if k in arrays}
            layout = BundleLayout.from_arrays(arrays, self.unit_alignment, enc)
            if self.layouts.setdefault(name, layout) != layout:
                raise ValueError(f"every layer must have the same {name!r} layout")
            offset = round_up(self._ffn.tell(), self.alignment)  # regions start aligned (O_DIRECT)
            self._ffn.write(b"\0" * (offset - self._ffn.tell()))
            n, crc = next(iter(arrays.values())).shape[0], 0
            step = max(1, PACK_BYTES // layout.disk_stride)
            for start in range(0, n, step):  # packed a few units at a time: the layer is not held twice
                part = {k: v[start : start + step] for k, v in arrays.items()}
                rows = layout.pack(part)
                if layout.encoded:
                    dense = BundleLayout.from_arrays(part, self.unit_alignment).pack(part)
                    if not np.array_equal(np.array(layout.expand(mx.array(rows), use_metal=False)), dense):
                        raise FlashFormatError(
                            f"layer {len(self.layers)} {name}: encoded units do not expand to the dense ones"
                        )
                self._ffn.write(rows.data)
                crc = zlib.crc32(rows, crc)
                units = crc32_at(rows, np.arange(len(rows)) * layout.disk_stride, layout.disk_stride).astype("<u4")
                self._unit_crcs.write(units.data)
                self._unit_crcs_crc = zlib.crc32(units, self._unit_crcs_crc)
            layer[name] = Region(len(self.layers), name, offset, n, layout.disk_stride, crc)
        self.layers.append(layer)

    def add_layer_in_place(self, regions: Dict[str, tuple]) -> None:
        """Append one layer whose units stay in the source files: region name -> (layout, extents (layout.Extent, one
        per component in row order), each unit's CRC-32 (uint32 [n_units]), the CRC-32 of its rows as read)."""
        layer = {}
        for name, (layout, extents, crcs, crc) in regions.items():
            if self.layouts.setdefault(name, layout) != layout:
                raise ValueError(f"every layer must have the same {name!r} layout")
            units = np.ascontiguousarray(crcs, dtype="<u4")
            self._unit_crcs.write(units.data)
            self._unit_crcs_crc = zlib.crc32(units, self._unit_crcs_crc)
            layer[name] = Region(len(self.layers), name, 0, len(units), layout.disk_stride, crc, tuple(extents))
        self.layers.append(layer)

    def finish(
        self,
        config: dict,
        resident: Dict[str, mx.array],
        manifest: dict,
        progress: bool = False,
        evaluate=None,
        blocks: Optional[Dict[str, str]] = None,
    ) -> None:
        """Write resident weights (without the biases symmetric codes imply), config and the manifest
        (`manifest` adds architecture fields; `blocks`: the modules whose weights are GGML blocks, {path: type}).

        `resident` is emptied as it is written: each array is evaluated, written and dropped in turn, so memory
        holds one of them at a time when `resident` holds the only references to them; the file is written once
        (TensorSpool.finish), and symmetric biases are left out as they come after their scales (any other moved
        over at the end), so the disk holds the resident weights once. `evaluate(name, array)`, if given, evaluates
        each array before it is written."""
        self.abort()
        total = sum(v.nbytes for v in resident.values())
        spool = TensorSpool(self.path / f".{RESIDENT}.spool", reserve=resident, metadata={"format": "mlx"})
        symmetric, late = {}, set()  # late: modules whose biases came before their scales, checked at the end
        with tqdm(
            total=total, desc="resident weights", unit="B", unit_scale=True, unit_divisor=1024, disable=not progress
        ) as bar:
            for k in list(resident):
                a = resident.pop(k)
                if evaluate is not None:
                    evaluate(k, a)
                bar.update(a.nbytes)
                path = k.removesuffix(".biases")
                if path != k and {f"{path}.weight", f"{path}.scales"} <= spool.entries.keys():
                    weight = spool.entries[f"{path}.weight"][1]
                    bits = _implied_bits(config, path, weight, spool.array(f"{path}.scales"), a)
                    if bits is not None:
                        symmetric[path] = bits
                        continue
                elif path != k:
                    late.add(path)
                spool.add(k, a)
                del a
        late = {f"{p}.{part}" for p in late for part in ("weight", "scales", "biases")}
        symmetric = dict(sorted({**symmetric, **symmetric_modules(_Spooled(spool, late), config)}.items()))
        names = [k for k in spool.entries if k.removesuffix(".biases") not in symmetric]
        with tqdm(
            total=spool.start + sum(spool.entries[k][3] for k in names),
            desc=f"{RESIDENT}: sha256",
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            disable=not progress,
        ) as bar:
            sha256 = spool.finish(self.path / RESIDENT, names, bar)
        with open(self.path / "config.json", "w") as f:
            json.dump(config, f, indent=2)
        full = {
            "format": FORMAT_NAME,
            "format_version": 5
            if self.sources or blocks
            else 4
            if symmetric
            else 3
            if self.unit_alignment != self.alignment
            else (2 if any(l.encoded for l in self.layouts.values()) else 1),
            **manifest,
            "alignment": self.alignment,
            "unit_alignment": self.unit_alignment,
            "layouts": {k: v.to_json() for k, v in self.layouts.items()},
            "layers": [
                {
                    "index": i,
                    "regions": {k: _region_json(r, self.layouts[k]) for k, r in regions.items()},
                }
                for i, regions in enumerate(self.layers)
            ],
            "resident": {
                "file": RESIDENT,
                "bytes": (self.path / RESIDENT).stat().st_size,
                "sha256": sha256,
                "symmetric": symmetric,
                **({"blocks": dict(sorted(blocks.items()))} if blocks else {}),
            },
            **(
                {"sources": self.sources}
                if self.sources
                else {"ffn_file": {"file": FFN, "bytes": (self.path / FFN).stat().st_size}}
            ),
            "unit_checksums": {"file": UNIT_CHECKSUMS, "crc32": self._unit_crcs_crc},
        }
        _write_json_atomic(self.path / MANIFEST, full)  # last: a directory without it never opens

    def abort(self):
        if self._ffn is not None:
            self._ffn.close()
        self._unit_crcs.close()


def _region_json(r: Region, layout: BundleLayout) -> dict:
    d = {"offset": r.offset, "n_units": r.n_units, "stride": r.stride, "crc32": r.crc32}
    if r.extents:
        d["extents"] = [
            {"component": c.name, "file": e.file, "offset": e.offset, "stride": e.stride, "bytes": e.nbytes, "at": e.at}
            | ({"length": e.length} if e.length != c.nbytes else {})
            for c, e in zip(layout.components, r.extents)
        ]
    return d


def _affine_quant(config: dict, path: str) -> Optional[dict]:
    """The affine quantisation (group_size, bits) mlx-lm's config gives module `path`, or None."""
    q = config.get("quantization")
    own = q.get(path, q) if isinstance(q, dict) else None
    if not isinstance(own, dict) or own.get("mode", "affine") != "affine" or "bits" not in own:
        return None
    return own


class _Spooled(dict):
    """A TensorSpool's arrays by name (those of `names`, if given): shapes at once, each array read back only when
    asked for."""

    def __init__(self, spool, names=None):
        super().__init__({k: e[1] for k, e in spool.entries.items() if names is None or k in names})
        self.spool = spool

    def __getitem__(self, name):
        return self.spool.array(name)

    def shape(self, name):
        return tuple(dict.__getitem__(self, name))


def symmetric_modules(resident: Dict[str, mx.array], config: dict) -> Dict[str, int]:
    """The quantised modules among `resident` whose biases are -2^(bits-1) x their scales exactly: {path: bits}."""
    shape = resident.shape if isinstance(resident, _Spooled) else lambda k: resident[k].shape
    out = {}
    for name in resident:
        path = name.removesuffix(".biases")
        if path == name or f"{path}.weight" not in resident or f"{path}.scales" not in resident:
            continue
        bits = _implied_bits(config, path, shape(f"{path}.weight"), resident[f"{path}.scales"], resident[name])
        if bits is not None:
            out[path] = bits
    return dict(sorted(out.items()))


def _implied_bits(config: dict, path: str, weight_shape, scales: mx.array, biases: mx.array) -> Optional[int]:
    """The bits of quantised module `path` if its biases are -2^(bits-1) x its scales exactly, else None."""
    q = _affine_quant(config, path)
    if q is None or weight_shape[-1] * 32 // q["bits"] != scales.shape[-1] * q["group_size"]:
        return None  # not the config's quantisation
    return q["bits"] if is_symmetric(biases, scales, q["bits"]) else None


def dense_ffn_weights(fd: FlashDir, layer: int) -> Dict[str, mx.array]:
    """One layer's FFN matrices as float32 canonical rows [n, d] (gate/up/down or fc1/fc2), dequantised."""
    arrays = fd.unpack_layer(layer)
    col = "down" if fd.ffn["kind"] == "glu" else "fc2"
    out = {}
    for name, info in fd.ffn["matrices"].items():
        w = arrays[f"{name}.weight"]
        q = info["quantization"]
        if q is not None and q.get("resident_scales"):  # the source's codes; the groups' scales are resident
            blocks = mx.arange(w.shape[0]) // q["group_size"]
            w = block_dequantize(w, blocks, *fd.group_tables(layer, name), q["bits"])
        elif q is not None:
            w = mx.dequantize(w, arrays[f"{name}.scales"], arrays[f"{name}.biases"], q["group_size"], q["bits"])
        w = w.astype(mx.float32)
        if info["transposed"] and name != col:  # dip layout: gate/up stored by input column [d, n]
            w = w.T
        out[name] = w
    mx.eval(out)
    return out
