"""The flash directory, format v1-v4: the one module that reads and writes it.

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

from ..compute.cpu_gemv import block_dequantize, is_symmetric, symmetric_biases
from ..engine.reader import open_reader
from ..errors import FlashFormatError, ReadError
from . import bitmap
from .safetensors_io import TensorSpool

FORMAT_NAME = "mlx_flash"
FORMAT_VERSION = 4  # v4: symmetric resident biases left out; v3: packed units; v2: encoded components; v1 (none)
VERSIONS = (1, 2, 3, 4)
PACKED_UNIT_ALIGNMENT = 16  # packed units: room for any component's element alignment (Metal reads words in place)
MANIFEST = "flash.json"
RESIDENT = "resident.safetensors"
FFN = "ffn.bin"
PREDICTORS = "predictors.safetensors"
DEFAULT_ALIGNMENT = 4096
PACK_BYTES = 32 << 20  # FlashWriter packs a layer's units this many bytes at a time

DTYPES = {
    "uint8": mx.uint8,
    "uint32": mx.uint32,
    "float16": mx.float16,
    "bfloat16": mx.bfloat16,
    "float32": mx.float32,
}


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


def dtype_name(dtype: mx.Dtype) -> str:
    for name, d in DTYPES.items():
        if d == dtype:
            return name
    raise FlashFormatError(f"dtype {dtype} cannot be stored in a bundle")


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def _as_bytes(a: mx.array) -> np.ndarray:
    """Rows of `a` as a uint8 numpy matrix [rows, row_bytes] (bfloat16 too)."""
    a = a.reshape(a.shape[0], -1)
    return np.array(mx.view(a, mx.uint8))


@dataclass(frozen=True)
class Encoding:
    """How a component's rows are stored on flash instead of their dense bytes.

    kind "bitmap": one ENDOR row (bitmap.py) of `length` values of `dtype` with `capacity`
    value slots. fill: what the positions not stored hold after expansion: "zero" (all
    bits 0, i.e. +0.0) or "affine_zero" (8-bit affine codes: the code of 0.0 of each group
    of `group_size`, computed from the component's .scales/.biases, see
    bitmap.affine_zero_codes).
    """

    kind: str
    dtype: str
    length: int
    capacity: int
    fill: str = "zero"
    group_size: int = 0

    KINDS = ("bitmap",)
    FILLS = ("zero", "affine_zero")

    @property
    def nbytes(self) -> int:
        return bitmap.row_bytes(self.length, self.capacity, self.dtype)

    def to_json(self) -> dict:
        d = {
            "kind": self.kind,
            "dtype": self.dtype,
            "length": self.length,
            "capacity": self.capacity,
            "fill": self.fill,
        }
        return dict(d, group_size=self.group_size) if self.fill == "affine_zero" else d

    @staticmethod
    def from_json(d: dict, component: str) -> "Encoding":
        if not isinstance(d, dict) or d.get("kind") not in Encoding.KINDS:
            kind = d.get("kind") if isinstance(d, dict) else d
            raise FlashFormatError(
                f"component {component!r}: unknown encoding {kind!r} (this mlx_flash reads: {', '.join(Encoding.KINDS)})"
            )
        e = Encoding(
            d["kind"],
            d["dtype"],
            int(d["length"]),
            int(d["capacity"]),
            d.get("fill", "zero"),
            int(d.get("group_size", 0)),
        )
        if e.dtype not in bitmap.DTYPES or e.fill not in Encoding.FILLS or not 0 < e.capacity <= e.length:
            raise FlashFormatError(f"component {component!r}: bad bitmap encoding {d}")
        if e.fill == "affine_zero" and (e.dtype != "uint8" or e.group_size <= 0 or e.length % e.group_size):
            raise FlashFormatError(
                f"component {component!r}: affine_zero fill needs uint8 values and a group size dividing {e.length}"
            )
        return e


@dataclass(frozen=True)
class Component:
    name: str
    dtype: str
    shape: tuple  # per neuron
    offset: int  # byte offset inside the (dense) bundle / cache row
    encoding: Optional[Encoding] = None  # None: stored on flash as its dense bytes
    disk_offset: Optional[int] = None  # byte offset inside the unit on flash (None: = offset)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * DTYPES[self.dtype].size

    @property
    def disk_nbytes(self) -> int:
        return self.encoding.nbytes if self.encoding else self.nbytes

    @property
    def encoding_fits(self) -> bool:
        """No encoding, or one that holds exactly the component's dense bytes."""
        return self.encoding is None or self.encoding.length * bitmap.DTYPES[self.encoding.dtype][0] == self.nbytes

    @property
    def flash_offset(self) -> int:
        return self.offset if self.disk_offset is None else self.disk_offset


@dataclass(frozen=True)
class BundleLayout:
    components: tuple
    stride: int  # bytes per cache row (the dense bundle), incl. padding
    encoded_stride: Optional[int] = None  # bytes per unit on flash when components are encoded

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.components)

    @property
    def encoded(self) -> bool:
        return self.encoded_stride is not None

    @property
    def disk_stride(self) -> int:
        """Bytes per unit on flash (= stride unless encoded)."""
        return self.stride if self.encoded_stride is None else self.encoded_stride

    @property
    def disk_nbytes(self) -> int:
        return sum(c.disk_nbytes for c in self.components)

    def encodings(self) -> Dict[str, Encoding]:
        return {c.name: c.encoding for c in self.components if c.encoding}

    @staticmethod
    def from_arrays(
        arrays: Dict[str, mx.array], alignment: int, encodings: Optional[Dict[str, Encoding]] = None
    ) -> "BundleLayout":
        """Components in the order of `arrays`; those named in `encodings` are stored encoded on flash."""
        encodings = encodings or {}
        unknown = set(encodings) - set(arrays)
        if unknown:
            raise ValueError(f"encodings for components not in the bundle: {sorted(unknown)}")
        components, offset, disk = [], 0, 0
        for name, a in arrays.items():
            c = Component(
                name, dtype_name(a.dtype), tuple(a.shape[1:]), offset, encodings.get(name), disk if encodings else None
            )
            if not c.encoding_fits:
                raise ValueError(
                    f"{name}: encoding of {c.encoding.length} {c.encoding.dtype} values, rows have {c.nbytes} bytes"
                )
            components.append(c)
            offset += c.nbytes
            disk += c.disk_nbytes
        stride = _round_up(max(offset, 1), alignment)
        return BundleLayout(tuple(components), stride, _round_up(max(disk, 1), alignment) if encodings else None)

    def to_json(self) -> dict:
        d = {"stride": self.stride, "bytes": self.nbytes, "components": []}
        for c in self.components:
            e = {"name": c.name, "dtype": c.dtype, "shape": list(c.shape), "offset": c.offset}
            if self.encoded:
                e["disk_offset"] = c.flash_offset
            if c.encoding:
                e["encoding"] = c.encoding.to_json()
            d["components"].append(e)
        if self.encoded:
            d.update(disk_stride=self.disk_stride, disk_bytes=self.disk_nbytes)
        return d

    @staticmethod
    def from_json(d: dict) -> "BundleLayout":
        comps = []
        for c in d["components"]:
            if c["dtype"] not in DTYPES:
                raise FlashFormatError(f"unknown component dtype {c['dtype']!r}")
            enc = Encoding.from_json(c["encoding"], c["name"]) if "encoding" in c else None
            comps.append(Component(c["name"], c["dtype"], tuple(c["shape"]), c["offset"], enc, c.get("disk_offset")))
        encoded = "disk_stride" in d
        if any(c.encoding for c in comps) and not encoded:
            raise FlashFormatError("encoded components but no disk_stride in the layout")
        layout = BundleLayout(tuple(comps), int(d["stride"]), int(d["disk_stride"]) if encoded else None)
        for c in layout.components:
            if not c.encoding_fits:
                raise FlashFormatError(
                    f"component {c.name!r}: its encoding holds {c.encoding.length} values, not {c.nbytes} bytes"
                )
            if c.flash_offset + c.disk_nbytes > layout.disk_stride:
                raise FlashFormatError(f"component {c.name!r} ends past the unit's {layout.disk_stride} bytes on flash")
            if c.encoding and c.encoding.fill == "affine_zero":  # expand needs the group scales/biases, dense
                groups = c.encoding.length // c.encoding.group_size
                for part in ("scales", "biases"):
                    g = next((x for x in comps if x.name == _sibling(c.name, part)), None)
                    if g is None or g.encoding or int(np.prod(g.shape)) != groups:
                        raise FlashFormatError(
                            f"component {c.name!r}: affine_zero fill needs a dense {_sibling(c.name, part)!r} of {groups} groups"
                        )
        return layout

    def pack(self, arrays: Dict[str, mx.array]) -> np.ndarray:
        """Component rows -> units as stored on flash [n, disk_stride] uint8 (encoded, zero padded)."""
        n = next(iter(arrays.values())).shape[0]
        out = np.zeros((n, self.disk_stride), dtype=np.uint8)
        for c in self.components:
            out[:, c.flash_offset : c.flash_offset + c.disk_nbytes] = self._encode(c, arrays)
        return out

    def _encode(self, c: Component, arrays) -> np.ndarray:
        if c.encoding is None:
            return _as_bytes(arrays[c.name])
        e = c.encoding
        values = mx.view(arrays[c.name].reshape(arrays[c.name].shape[0], -1), bitmap.DTYPES[e.dtype][2])
        mask = None
        if e.fill == "affine_zero":  # store the codes that differ from their group's code of 0.0
            zero = self._affine_zero(c, arrays[_sibling(c.name, "scales")], arrays[_sibling(c.name, "biases")])
            mask = np.array(values != zero)
        try:
            return bitmap.encode_rows(values, e.capacity, mask=mask)[0]
        except ValueError as err:
            raise ValueError(f"{c.name}: {err} (prune it to at most {e.capacity} non-zeros per row)") from err

    @staticmethod
    def _affine_zero(c: Component, scales: mx.array, biases: mx.array) -> mx.array:
        """[k, length] uint8: each position's group code of 0.0."""
        k = scales.shape[0]
        zero = bitmap.affine_zero_codes(scales.reshape(k, -1), biases.reshape(k, -1), bits=8)
        return mx.repeat(zero, c.encoding.group_size, axis=1)

    def expand(self, units: mx.array, use_metal: Optional[bool] = None) -> mx.array:
        """Units as stored on flash [k, disk_stride] uint8 -> dense cache rows [k, stride] uint8 (lazy)."""
        if not self.encoded:
            return units
        k = units.shape[0]
        raw = {c.name: units[:, c.flash_offset : c.flash_offset + c.disk_nbytes] for c in self.components}
        parts = []
        for c in self.components:  # in offset order: they tile the row
            e = c.encoding
            if e is None:
                parts.append(raw[c.name])
                continue
            fill = None
            if e.fill == "affine_zero":  # the group's code of 0.0, from the dense scales/biases
                sc, bi = (self.component(_sibling(c.name, s)) for s in ("scales", "biases"))
                scales = mx.view(raw[sc.name], DTYPES[sc.dtype]).reshape(k, -1)
                biases = mx.view(raw[bi.name], DTYPES[bi.dtype]).reshape(k, -1)
                fill = bitmap.affine_zero_codes(scales, biases, bits=8)
            values = bitmap.expand(raw[c.name], e.length, e.dtype, use_metal, fill)
            parts.append(mx.view(values, mx.uint8).reshape(k, -1))
        if self.stride > self.nbytes:
            parts.append(mx.zeros((k, self.stride - self.nbytes), mx.uint8))
        return mx.concatenate(parts, axis=1)

    def component(self, name: str) -> Component:
        for c in self.components:
            if c.name == name:
                return c
        raise FlashFormatError(f"the bundle has no component {name!r}")

    def unpack(self, rows: mx.array) -> Dict[str, mx.array]:
        """Bundles [k, stride] uint8 (an mx.array, e.g. cache rows) -> component arrays [k, *shape]."""
        k = rows.shape[0]
        out = {}
        for c in self.components:
            raw = rows[:, c.offset : c.offset + c.nbytes]
            out[c.name] = mx.view(raw, DTYPES[c.dtype]).reshape(k, *c.shape)
        return out


def _sibling(name: str, part: str) -> str:
    """'gate.weight' -> 'gate.scales'."""
    return name.rsplit(".", 1)[0] + "." + part


@dataclass(frozen=True)
class Region:
    """One layer's run of units (bundles) of one layout in ffn.bin."""

    layer: int
    name: str  # "neurons" (one unit per FFN neuron) or "inputs" (one per input dim, the dip layout)
    offset: int  # byte offset of unit 0 in ffn.bin
    n_units: int
    stride: int
    crc32: int

    @property
    def nbytes(self) -> int:
        return self.n_units * self.stride

    def unit_offset(self, unit: int) -> int:
        return self.offset + unit * self.stride

    def unit_offsets(self, units) -> np.ndarray:
        """int64 file offsets of `units` in ffn.bin, each `stride` bytes long: the one place units become bytes."""
        return self.offset + np.asarray(units, dtype=np.int64) * self.stride


class FlashDir:
    """A flash directory opened for reading: manifest checked, files present, sizes right.

    Checksums are only verified by `verify()` (reading everything is too slow for a load).
    """

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise FlashFormatError(
                f"{self.path}: not a directory (expected a flash directory made by mlx_flash.convert)"
            )
        self.manifest = self._read_manifest()
        m = self.manifest
        try:
            self.alignment = int(m["alignment"])
            self.unit_alignment = int(m.get("unit_alignment", self.alignment))  # v1/v2: units padded to the alignment
            self.layouts: Dict[str, BundleLayout] = {k: BundleLayout.from_json(v) for k, v in m["layouts"].items()}
            self.layers: List[Dict[str, Region]] = [
                {
                    name: Region(l["index"], name, r["offset"], r["n_units"], r["stride"], r["crc32"])
                    for name, r in l["regions"].items()
                }
                for l in m["layers"]
            ]
            for regions in self.layers:
                for r in regions.values():
                    if r.stride != self.layouts[r.name].disk_stride:
                        raise ValueError(f"layer {r.layer} region {r.name}: stride differs from its layout")
            if self.version == 1 and any(l.encoded for l in self.layouts.values()):
                raise ValueError("encoded components need format version 2")
            if self.version < 3 and self.unit_alignment != self.alignment:
                raise ValueError("packed units need format version 3")
        except FlashFormatError as e:
            raise FlashFormatError(f"{self.path / MANIFEST}: {e}") from e
        except (KeyError, TypeError, ValueError) as e:
            raise FlashFormatError(f"{self.path / MANIFEST}: malformed manifest ({type(e).__name__}: {e})") from e
        self.config = self._read_json("config.json")
        self._check_files()
        self._resident_index = None

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

    def _check_files(self):
        for name in (RESIDENT, FFN):
            if not (self.path / name).is_file():
                raise FlashFormatError(f"{self.path / name}: missing file")
        expected = self.manifest["resident"]["bytes"]
        size = (self.path / RESIDENT).stat().st_size
        if size != expected:
            raise FlashFormatError(
                f"{self.path / RESIDENT}: {size} bytes, manifest says {expected} (truncated or replaced)"
            )
        size = (self.path / FFN).stat().st_size
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

    # -- properties ----------------------------------------------------------
    def regions(self) -> Iterable[Region]:
        """Every region of every layer, in file order."""
        return [r for regions in self.layers for r in regions.values()]

    @property
    def ffn_path(self) -> Path:
        return self.path / FFN

    @property
    def architecture(self) -> str:
        return self.manifest["architecture"]

    @property
    def ffn(self) -> dict:
        """FFN description: kind, activation, layout, per-matrix quantisation (see architectures.py)."""
        return self.manifest["ffn"]

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
        return self.manifest["resident"].get("symmetric", {})

    def load_resident(self, biases: bool = True) -> Dict[str, mx.array]:
        """The resident weights as mlx-lm names them; biases=False leaves out the symmetric modules' biases
        (the runtime's layers derive them: `symmetric`)."""
        try:
            arrays = mx.load(str(self.path / RESIDENT))
        except Exception as e:
            raise FlashFormatError(f"{self.path / RESIDENT}: cannot be read ({e})") from e
        if biases:
            arrays.update(
                {f"{p}.biases": symmetric_biases(arrays[f"{p}.scales"], b) for p, b in self.symmetric.items()}
            )
        return arrays

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
        """All units of one layer's region as [n_units, stride] uint8 (one sequential read)."""
        r = self.layers[layer][name]
        buf = np.empty((r.n_units, r.stride), dtype=np.uint8)
        try:  # through the reader, as every read (cached: a whole region, read once at load)
            with open_reader(self.ffn_path, threads=1, direct=False) as reader:
                reader.read(buf, [r.offset], [r.nbytes], [0])
        except ReadError as e:
            raise FlashFormatError(f"{self.ffn_path}: cannot read layer {layer} ({e})") from e
        return buf

    def unpack_layer(self, layer: int) -> Dict[str, mx.array]:
        """Every component array of one layer, read from disk (e.g. for an all-resident model), expanded."""
        arrays = {}
        for name, layout in self.layouts.items():
            arrays.update(layout.unpack(layout.expand(mx.array(self.read_region(layer, name)))))
        quant = self.ffn.get("quantization") or {n: m["quantization"] for n, m in self.ffn.get("matrices", {}).items()}
        for name, q in quant.items():  # symmetric rows store no biases: the consumers get them
            if q is not None and q.get("symmetric") and f"{name}.scales" in arrays:
                arrays[f"{name}.biases"] = symmetric_biases(arrays[f"{name}.scales"], q["bits"])
        return arrays

    def group_tables(self, layer: int, name: str):
        """(scales, biases or None if symmetric) [n / group_size, d] of matrix `name` stored as the source's
        codes (convert --down-bits source), from resident.safetensors."""
        tables = self.load_resident()
        prefix = f"{self.ffn['mlp_paths'][layer]}.{name}"
        return tables[f"{prefix}.scales"], tables.get(f"{prefix}.biases")

    def verify(self, progress=None) -> None:
        """Re-check sizes, alignment and checksums; raise FlashFormatError naming the first bad part."""
        if _sha256(self.path / RESIDENT) != self.manifest["resident"]["sha256"]:
            raise FlashFormatError(f"{self.path / RESIDENT}: checksum mismatch (corrupted)")
        regions = progress(self.regions()) if progress else self.regions()
        for r in regions:
            if zlib.crc32(self.read_region(r.layer, r.name)) != r.crc32:
                raise FlashFormatError(f"{self.ffn_path}: checksum mismatch in layer {r.layer} ({r.name}; corrupted)")


def _write_json_atomic(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _sha256(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


class FlashWriter:
    """Writes a flash directory into `path` (the caller picks a temporary name and renames)."""

    def __init__(
        self,
        path,
        alignment: int = DEFAULT_ALIGNMENT,
        encodings: Optional[Dict[str, Encoding]] = None,
        unit_alignment: Optional[int] = None,
    ):
        """`encodings` (component name -> Encoding): store those components encoded (format v2). Regions start at
        multiples of `alignment`; units are `unit_alignment` apart (None: the alignment, every unit padded to it;
        PACKED_UNIT_ALIGNMENT: packed, format v3)."""
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
        self._ffn = open(self.path / FFN, "wb")

    def add_layer(self, regions: Dict[str, Dict[str, mx.array]]) -> None:
        """Append one layer: region name -> {component name -> [n_units, ...]}.

        Encoded units are expanded again and checked against the dense bundle (lossless)."""
        layer = {}
        for name, arrays in regions.items():
            enc = {k: e for k, e in self.encodings.items() if k in arrays}
            layout = BundleLayout.from_arrays(arrays, self.unit_alignment, enc)
            if self.layouts.setdefault(name, layout) != layout:
                raise ValueError(f"every layer must have the same {name!r} layout")
            offset = _round_up(self._ffn.tell(), self.alignment)  # regions start aligned (O_DIRECT)
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
            layer[name] = Region(len(self.layers), name, offset, n, layout.disk_stride, crc)
        self.layers.append(layer)

    def finish(self, config: dict, resident: Dict[str, mx.array], manifest: dict, progress: bool = False) -> None:
        """Write resident weights (without the biases symmetric codes imply), config and the manifest
        (`manifest` adds architecture fields).

        `resident` is emptied as it is written: each array is evaluated, spooled to a scratch file and dropped in
        turn, so memory holds one of them at a time when `resident` holds the only references to them."""
        self._ffn.close()
        names = list(resident)
        total = sum(v.nbytes for v in resident.values())
        spool = TensorSpool(self.path / f".{RESIDENT}.spool")
        with tqdm(
            total=total, desc="resident weights", unit="B", unit_scale=True, unit_divisor=1024, disable=not progress
        ) as bar:
            for k in names:
                a = resident.pop(k)
                spool.add(k, a)
                bar.update(a.nbytes)
                del a
        symmetric = symmetric_modules(_Spooled(spool), config)
        names = [k for k in names if k.removesuffix(".biases") not in symmetric]
        with tqdm(
            total=sum(spool.entries[k][3] for k in names),
            desc=f"write {RESIDENT} + sha256",
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            disable=not progress,
        ) as bar:
            sha256 = spool.save(self.path / RESIDENT, names, {"format": "mlx"}, bar, checksum=True)
        with open(self.path / "config.json", "w") as f:
            json.dump(config, f, indent=2)
        full = {
            "format": FORMAT_NAME,
            "format_version": 4
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
                    "regions": {
                        k: {"offset": r.offset, "n_units": r.n_units, "stride": r.stride, "crc32": r.crc32}
                        for k, r in regions.items()
                    },
                }
                for i, regions in enumerate(self.layers)
            ],
            "resident": {
                "file": RESIDENT,
                "bytes": (self.path / RESIDENT).stat().st_size,
                "sha256": sha256,
                "symmetric": symmetric,
            },
            "ffn_file": {"file": FFN, "bytes": (self.path / FFN).stat().st_size},
        }
        _write_json_atomic(self.path / MANIFEST, full)  # last: a directory without it never opens

    def abort(self):
        self._ffn.close()


def _affine_quant(config: dict, path: str) -> Optional[dict]:
    """The affine quantisation (group_size, bits) mlx-lm's config gives module `path`, or None."""
    q = config.get("quantization")
    own = q.get(path, q) if isinstance(q, dict) else None
    if not isinstance(own, dict) or own.get("mode", "affine") != "affine" or "bits" not in own:
        return None
    return own


class _Spooled(dict):
    """A TensorSpool's arrays by name: shapes at once, each array read back only when asked for."""

    def __init__(self, spool):
        super().__init__({k: e[1] for k, e in spool.entries.items()})
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
        q = _affine_quant(config, path)
        if q is None or shape(f"{path}.weight")[-1] * 32 // q["bits"] != shape(f"{path}.scales")[-1] * q["group_size"]:
            continue  # not the config's quantisation
        if is_symmetric(resident[name], resident[f"{path}.scales"], q["bits"]):
            out[path] = q["bits"]
    return dict(sorted(out.items()))


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
