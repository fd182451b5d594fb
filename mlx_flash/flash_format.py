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
from dataclasses import asdict, dataclass
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
DEFAULT_ALIGNMENT = 4096

_DTYPES = {
    "uint8": mx.uint8,
    "uint32": mx.uint32,
    "float16": mx.float16,
    "bfloat16": mx.bfloat16,
    "float32": mx.float32,
}


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
class LayerInfo:
    index: int
    offset: int  # byte offset of the layer's first bundle in ffn.bin
    n_neurons: int
    stride: int
    crc32: int

    @property
    def nbytes(self) -> int:
        return self.n_neurons * self.stride

    def bundle_offset(self, neuron: int) -> int:
        return self.offset + neuron * self.stride


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
            self.layout = BundleLayout.from_json(m["bundle"])
            self.layers: List[LayerInfo] = [
                LayerInfo(l["index"], l["offset"], l["n_neurons"], l["stride"], l["crc32"])
                for l in m["layers"]
            ]
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
        for l in self.layers:
            if l.offset % self.alignment or l.stride % self.alignment:
                raise FlashFormatError(f"layer {l.index}: offset {l.offset} or stride {l.stride} not aligned to {self.alignment}")
            if l.offset + l.nbytes > size:
                raise FlashFormatError(
                    f"{self.path / FFN}: truncated: layer {l.index} ends at byte {l.offset + l.nbytes}, file has {size}"
                )

    # -- properties ----------------------------------------------------------
    @property
    def ffn_path(self) -> Path:
        return self.path / FFN

    @property
    def architecture(self) -> str:
        return self.manifest["architecture"]

    @property
    def ffn(self) -> dict:
        """FFN description: kind, activation, per-matrix quantisation (see architectures.py)."""
        return self.manifest["ffn"]

    @property
    def resident_bytes(self) -> int:
        return self.manifest["resident"]["bytes"]

    @property
    def ffn_bytes(self) -> int:
        return sum(l.nbytes for l in self.layers)

    # -- data ------------------------------------------------------------------
    def load_resident(self) -> Dict[str, mx.array]:
        try:
            return mx.load(str(self.path / RESIDENT))
        except Exception as e:
            raise FlashFormatError(f"{self.path / RESIDENT}: cannot be read ({e})") from None

    def read_layer(self, index: int) -> np.ndarray:
        """All bundles of one layer as [n_neurons, stride] uint8 (one sequential read)."""
        l = self.layers[index]
        buf = np.empty((l.n_neurons, l.stride), dtype=np.uint8)
        with open(self.ffn_path, "rb") as f:
            f.seek(l.offset)
            got = f.readinto(memoryview(buf).cast("B"))
        if got != l.nbytes:
            raise FlashFormatError(f"{self.ffn_path}: short read in layer {index} ({got} of {l.nbytes} bytes)")
        return buf

    def verify(self, progress=None) -> None:
        """Re-check sizes, alignment and checksums; raise FlashFormatError naming the first bad part."""
        import hashlib

        h = hashlib.sha256()
        with open(self.path / RESIDENT, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        if h.hexdigest() != self.manifest["resident"]["sha256"]:
            raise FlashFormatError(f"{self.path / RESIDENT}: checksum mismatch (corrupted)")
        layers = progress(self.layers) if progress else self.layers
        for l in layers:
            if zlib.crc32(self.read_layer(l.index)) != l.crc32:
                raise FlashFormatError(f"{self.ffn_path}: checksum mismatch in layer {l.index} (corrupted)")


class FlashWriter:
    """Writes a flash directory into `path` (the caller picks a temporary name and renames)."""

    def __init__(self, path, alignment: int = DEFAULT_ALIGNMENT):
        if alignment < 512 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two >= 512, got {alignment}")
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=False)
        self.alignment = alignment
        self.layout: Optional[BundleLayout] = None
        self.layers: List[LayerInfo] = []
        self._ffn = open(self.path / FFN, "wb")

    def add_layer(self, arrays: Dict[str, mx.array]) -> LayerInfo:
        """Append one layer's bundles: `arrays` maps component name -> [n_neurons, ...]."""
        layout = BundleLayout.from_arrays(arrays, self.alignment)
        if self.layout is None:
            self.layout = layout
        elif layout != self.layout:
            raise ValueError("every layer must have the same bundle layout")
        rows = layout.pack(arrays)
        offset = self._ffn.tell()
        self._ffn.write(rows.data)
        info = LayerInfo(len(self.layers), offset, rows.shape[0], layout.stride, zlib.crc32(rows))
        self.layers.append(info)
        return info

    def finish(self, config: dict, resident: Dict[str, mx.array], manifest: dict) -> None:
        """Write resident weights, config and the manifest (`manifest` adds architecture fields)."""
        import hashlib

        self._ffn.close()
        mx.save_safetensors(str(self.path / RESIDENT), resident, metadata={"format": "mlx"})
        h = hashlib.sha256()
        with open(self.path / RESIDENT, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        with open(self.path / "config.json", "w") as f:
            json.dump(config, f, indent=2)
        full = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            **manifest,
            "alignment": self.alignment,
            "bundle": self.layout.to_json(),
            "layers": [asdict(l) for l in self.layers],
            "resident": {"file": RESIDENT, "bytes": (self.path / RESIDENT).stat().st_size, "sha256": h.hexdigest()},
            "ffn_file": {"file": FFN, "bytes": (self.path / FFN).stat().st_size},
        }
        # The manifest is written last: a directory without it never opens.
        tmp = self.path / (MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            json.dump(full, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path / MANIFEST)

    def abort(self):
        self._ffn.close()
