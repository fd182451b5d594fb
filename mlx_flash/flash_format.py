"""The flash directory, format v1: the one module that reads and writes it.

    <dir>/config.json           model config (mlx-lm / Hugging Face style)
    <dir>/tokenizer*            tokenizer files
    <dir>/flash.json            manifest (this module's schema, versioned)
    <dir>/resident.safetensors  every weight that is not an FFN bundle
    <dir>/ffn.bin               all bundles, layer after layer

A bundle holds one neuron's FFN weights contiguously, as rows of "components"
(e.g. gate.weight, up.weight, down.weight for SwiGLU; fc1.weight, fc2.weight
for ReLU; quantised matrices add .scales/.biases). Bundles are padded to
`stride` bytes, a multiple of the alignment, so every bundle starts aligned
and can be read with O_DIRECT. The manifest lists the components with their
dtype, per-neuron shape and byte offset inside the bundle, so a reader can
view any bundle (or a cache row holding one) as arrays without copying.
"""

import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional

import mlx.core as mx
import numpy as np

from .errors import FlashFormatError

FORMAT_NAME = "mlx_flash"
FORMAT_VERSION = 1
MANIFEST = "flash.json"
RESIDENT = "resident.safetensors"
FFN = "ffn.bin"
PREDICTORS = "predictors.safetensors"
DEFAULT_ALIGNMENT = 4096

_DTYPES = {
    "uint8": mx.uint8,
    "uint32": mx.uint32,
    "float16": mx.float16,
    "bfloat16": mx.bfloat16,
    "float32": mx.float32,
}


_SAFETENSORS_DTYPES = {
    "F16": mx.float16, "BF16": mx.bfloat16, "F32": mx.float32, "U32": mx.uint32, "I32": mx.int32,
    "U8": mx.uint8, "I8": mx.int8, "U16": mx.uint16, "I16": mx.int16, "I64": mx.int64, "U64": mx.uint64,
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

    def nbytes_as(self, cast=None) -> int:
        """Bytes in memory when `cast(name) -> dtype name or None` casts float tensors on load."""
        target = cast(self.name) if cast and mx.issubdtype(self.dtype, mx.floating) else None
        return self.nbytes if not target else self.nbytes // self.dtype.size * _DTYPES[target].size


def dtype_name(dtype: mx.Dtype) -> str:
    for name, d in _DTYPES.items():
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
class Component:
    name: str
    dtype: str
    shape: tuple  # per neuron
    offset: int  # byte offset inside the bundle

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * _DTYPES[self.dtype].size


@dataclass(frozen=True)
class BundleLayout:
    components: tuple
    stride: int  # bytes per bundle on disk and per cache row, incl. padding

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.components)

    @staticmethod
    def from_arrays(arrays: Dict[str, mx.array], alignment: int) -> "BundleLayout":
        components, offset = [], 0
        for name, a in arrays.items():
            c = Component(name, dtype_name(a.dtype), tuple(a.shape[1:]), offset)
            components.append(c)
            offset += c.nbytes
        return BundleLayout(tuple(components), _round_up(max(offset, 1), alignment))

    def to_json(self) -> dict:
        return {
            "stride": self.stride,
            "bytes": self.nbytes,
            "components": [
                {"name": c.name, "dtype": c.dtype, "shape": list(c.shape), "offset": c.offset}
                for c in self.components
            ],
        }

    @staticmethod
    def from_json(d: dict) -> "BundleLayout":
        comps = tuple(
            Component(c["name"], c["dtype"], tuple(c["shape"]), c["offset"])
            for c in d["components"]
        )
        for c in comps:
            if c.dtype not in _DTYPES:
                raise FlashFormatError(f"unknown component dtype {c.dtype!r}")
        return BundleLayout(comps, int(d["stride"]))

    def pack(self, arrays: Dict[str, mx.array]) -> np.ndarray:
        """Component rows -> bundles [n, stride] uint8 (zero padded)."""
        n = next(iter(arrays.values())).shape[0]
        out = np.zeros((n, self.stride), dtype=np.uint8)
        for c in self.components:
            out[:, c.offset : c.offset + c.nbytes] = _as_bytes(arrays[c.name])
        return out

    def unpack(self, rows: mx.array) -> Dict[str, mx.array]:
        """Bundles [k, stride] uint8 (an mx.array, e.g. cache rows) -> component arrays [k, *shape]."""
        k = rows.shape[0]
        out = {}
        for c in self.components:
            raw = rows[:, c.offset : c.offset + c.nbytes]
            out[c.name] = mx.view(raw, _DTYPES[c.dtype]).reshape(k, *c.shape)
        return out


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


class FlashDir:
    """A flash directory opened for reading: manifest checked, files present, sizes right.

    Checksums are only verified by `verify()` (reading everything is too slow for a load).
    """

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise FlashFormatError(f"{self.path}: not a directory (expected a flash directory made by mlx_flash.convert)")
        self.manifest = self._read_manifest()
        m = self.manifest
        try:
            self.alignment = int(m["alignment"])
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
                    if r.stride != self.layouts[r.name].stride:
                        raise ValueError(f"layer {r.layer} region {r.name}: stride differs from its layout")
        except (KeyError, TypeError, ValueError) as e:
            raise FlashFormatError(f"{self.path / MANIFEST}: malformed manifest ({type(e).__name__}: {e})") from None
        self.config = self._read_json("config.json")
        self._check_files()

    # -- manifest and files -------------------------------------------------
    def _read_json(self, name):
        p = self.path / name
        if not p.is_file():
            raise FlashFormatError(f"{p}: missing file")
        try:
            with open(p) as f:
                return json.load(f)
        except json.JSONDecodeError as e:
            raise FlashFormatError(f"{p}: not valid JSON ({e})") from None

    def _read_manifest(self):
        m = self._read_json(MANIFEST)
        if m.get("format") != FORMAT_NAME:
            raise FlashFormatError(f"{self.path / MANIFEST}: not an mlx_flash manifest")
        v = m.get("format_version")
        if v != FORMAT_VERSION:
            raise FlashFormatError(
                f"{self.path / MANIFEST}: format version {v!r} is not supported "
                f"(this mlx_flash reads version {FORMAT_VERSION}); re-convert the model"
            )
        return m

    def _check_files(self):
        for name in (RESIDENT, FFN):
            if not (self.path / name).is_file():
                raise FlashFormatError(f"{self.path / name}: missing file")
        expected = self.manifest["resident"]["bytes"]
        size = (self.path / RESIDENT).stat().st_size
        if size != expected:
            raise FlashFormatError(f"{self.path / RESIDENT}: {size} bytes, manifest says {expected} (truncated or replaced)")
        size = (self.path / FFN).stat().st_size
        for r in self.regions():
            if r.offset % self.alignment or r.stride % self.alignment:
                raise FlashFormatError(
                    f"layer {r.layer} {r.name}: offset {r.offset} or stride {r.stride} not aligned to {self.alignment}"
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

        What streaming below the resident floor reads tensors (or rows of them) with."""
        path = self.path / RESIDENT
        try:
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                if n > self.resident_bytes - 8:
                    raise ValueError(f"header length {n} exceeds the file")
                header = json.loads(f.read(n))
            start = 8 + n
            index = {
                name: ResidentTensor(name, start + t["data_offsets"][0], t["data_offsets"][1] - t["data_offsets"][0],
                                     _SAFETENSORS_DTYPES[t["dtype"]], tuple(t["shape"]))
                for name, t in header.items()
                if name != "__metadata__"
            }
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise FlashFormatError(f"{path}: unreadable safetensors header ({type(e).__name__}: {e})") from None
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
        """Bytes of the model's weights: resident as stored + FFN unit data without padding.

        What budgets given as a percentage ("50%") are a percentage of."""
        return self.resident_bytes + sum(r.n_units * self.layouts[r.name].nbytes for r in self.regions())

    @property
    def ffn_bytes(self) -> int:
        return sum(r.nbytes for r in self.regions())

    # -- data ------------------------------------------------------------------
    def load_resident(self) -> Dict[str, mx.array]:
        try:
            return mx.load(str(self.path / RESIDENT))
        except Exception as e:
            raise FlashFormatError(f"{self.path / RESIDENT}: cannot be read ({e})") from None

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
            raise FlashFormatError(f"{path}: cannot be read ({e})") from None

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
        with open(self.ffn_path, "rb") as f:
            f.seek(r.offset)
            got = f.readinto(memoryview(buf).cast("B"))
        if got != r.nbytes:
            raise FlashFormatError(f"{self.ffn_path}: short read in layer {layer} ({got} of {r.nbytes} bytes)")
        return buf

    def unpack_layer(self, layer: int) -> Dict[str, mx.array]:
        """Every component array of one layer, read from disk (e.g. for an all-resident model)."""
        arrays = {}
        for name, layout in self.layouts.items():
            arrays.update(layout.unpack(mx.array(self.read_region(layer, name))))
        return arrays

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

    def __init__(self, path, alignment: int = DEFAULT_ALIGNMENT):
        if alignment < 512 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two >= 512, got {alignment}")
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=False)
        self.alignment = alignment
        self.layouts: Dict[str, BundleLayout] = {}
        self.layers: List[Dict[str, Region]] = []
        self._ffn = open(self.path / FFN, "wb")

    def add_layer(self, regions: Dict[str, Dict[str, mx.array]]) -> None:
        """Append one layer: region name -> {component name -> [n_units, ...]}."""
        layer = {}
        for name, arrays in regions.items():
            layout = BundleLayout.from_arrays(arrays, self.alignment)
            if self.layouts.setdefault(name, layout) != layout:
                raise ValueError(f"every layer must have the same {name!r} layout")
            rows = layout.pack(arrays)
            offset = self._ffn.tell()
            self._ffn.write(rows.data)
            layer[name] = Region(len(self.layers), name, offset, rows.shape[0], layout.stride, zlib.crc32(rows))
        self.layers.append(layer)

    def finish(self, config: dict, resident: Dict[str, mx.array], manifest: dict) -> None:
        """Write resident weights, config and the manifest (`manifest` adds architecture fields)."""
        self._ffn.close()
        mx.save_safetensors(str(self.path / RESIDENT), resident, metadata={"format": "mlx"})
        with open(self.path / "config.json", "w") as f:
            json.dump(config, f, indent=2)
        full = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            **manifest,
            "alignment": self.alignment,
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
                "sha256": _sha256(self.path / RESIDENT),
            },
            "ffn_file": {"file": FFN, "bytes": (self.path / FFN).stat().st_size},
        }
        _write_json_atomic(self.path / MANIFEST, full)  # last: a directory without it never opens

    def abort(self):
        self._ffn.close()
