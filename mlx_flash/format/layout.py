"""How units lie in a flash directory's FFN file and in DRAM: components (a matrix's rows in a unit), encodings
(ENDOR bitmap rows on flash, expanded on reading), a region's layout (`BundleLayout`: offsets, strides, packing),
one layer's region (`Region`: where its units start in the file) and where a matrix lives in a cache row
(`RowMatrix`).

A bundle holds one unit's weights contiguously, as rows of "components" (e.g. gate.weight, up.weight, down.weight for
SwiGLU; quantised matrices add .scales/.biases); the manifest (directory.py) lists them with their dtype, per-unit
shape and byte offset inside the bundle, so a reader can view any bundle (or a cache row holding one) as arrays
without copying.
"""

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Dict, Optional

import mlx.core as mx
import numpy as np

from ..errors import FlashFormatError
from ..io.checks import crc32_at
from ..io.sources import FILE_SHIFT
from . import bitmap

PACKED_UNIT_ALIGNMENT = 16  # packed units: room for any component's element alignment (Metal reads words in place)


DTYPES = {
    "uint8": mx.uint8,
    "uint32": mx.uint32,
    "float16": mx.float16,
    "bfloat16": mx.bfloat16,
    "float32": mx.float32,
}


def dtype_name(dtype: mx.Dtype) -> str:
    for name, d in DTYPES.items():
        if d == dtype:
            return name
    raise FlashFormatError(f"dtype {dtype} cannot be stored in a bundle")


def round_up(n: int, multiple: int) -> int:
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
                f"component {component!r}: unknown encoding {kind!r} "
                f"(this mlx_flash reads: {', '.join(Encoding.KINDS)})"
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
        stride = round_up(max(offset, 1), alignment)
        return BundleLayout(tuple(components), stride, round_up(max(disk, 1), alignment) if encodings else None)

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
            if not (is_count(c["offset"]) and all(is_count(x) and x > 0 for x in c["shape"])):
                raise FlashFormatError(f"component {c['name']!r}: offset and shape must be counts, not {c}")
            enc = Encoding.from_json(c["encoding"], c["name"]) if "encoding" in c else None
            comps.append(Component(c["name"], c["dtype"], tuple(c["shape"]), c["offset"], enc, c.get("disk_offset")))
        names = [c.name for c in comps]
        if len(set(names)) != len(names) or not all(isinstance(n, str) and "." in n for n in names):
            raise FlashFormatError(f"component names must be distinct 'matrix.part' names, not {names}")
        encoded = "disk_stride" in d
        if any(c.encoding for c in comps) and not encoded:
            raise FlashFormatError("encoded components but no disk_stride in the layout")
        if not all(is_count(d[k]) and d[k] > 0 for k in ("stride", "disk_stride") if k in d):
            raise FlashFormatError(f"a layout's stride must be a positive count, not {d['stride']!r}")
        layout = BundleLayout(tuple(comps), d["stride"], d["disk_stride"] if encoded else None)
        for c in layout.components:
            if c.offset + c.nbytes > layout.stride:
                raise FlashFormatError(f"component {c.name!r} ends past the unit's {layout.stride} bytes in a row")
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
                            f"component {c.name!r}: affine_zero fill needs a dense "
                            f"{_sibling(c.name, part)!r} of {groups} groups"
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


# -- a matrix in a cache row (uint8 rows [capacity, stride]): in slot s, component `<name>.weight` (float, or packed
# uint32 when quantised, with `<name>.scales` / `<name>.biases`) at its byte offset in rows[s]


@dataclass(frozen=True)
class RowMatrix:
    """Where matrix `name` lives in a cache row, and what it holds."""

    name: str
    weight: Component
    scales: Optional[Component]
    biases: Optional[Component]
    n: int  # logical row length (dequantised)
    bits: int  # 0: float rows
    group_size: int
    symmetric: bool = False  # no biases component: bias = -2^(bits-1) * scale

    @property
    def float_dtype(self) -> mx.Dtype:
        """The stored float type: the weights, or the scales/biases when quantised."""
        return DTYPES[(self.scales or self.weight).dtype]


@lru_cache(maxsize=256)
def row_matrix(
    layout: BundleLayout,
    name: str,
    bits: Optional[int] = None,
    group_size: Optional[int] = None,
    symmetric: bool = False,
) -> RowMatrix:
    """Resolve matrix `name` ("gate", "fc1", ...) of `layout` for quantisation (bits, group_size[, symmetric: no
    biases stored]) or float (None)."""
    comps = {c.name: c for c in layout.components}
    weight = comps.get(f"{name}.weight")
    if weight is None:
        have = sorted({c.name.rsplit(".", 1)[0] for c in layout.components})
        raise ValueError(f"the layout has no matrix {name!r} (it has {', '.join(have)})")
    if len(weight.shape) != 1:
        raise ValueError(f"{name}.weight: expected one row per unit, got per-unit shape {weight.shape}")
    if bits is None:
        if weight.dtype not in ("float16", "bfloat16", "float32"):
            raise ValueError(f"{name}.weight is {weight.dtype}: quantised rows need quant={{'bits', 'group_size'}}")
        return RowMatrix(name, weight, None, None, weight.shape[0], 0, 1)
    scales, biases = comps.get(f"{name}.scales"), comps.get(f"{name}.biases")
    if symmetric:
        biases = scales
    if weight.dtype != "uint32" or scales is None or biases is None:
        raise ValueError(f"{name}: quant={{'bits': {bits}, ...}} but the layout does not hold quantised rows of it")
    if bits not in (2, 3, 4, 5, 6, 8):
        raise ValueError(f"{name}: unsupported bits {bits}")
    n = weight.shape[0] * 32 // bits
    if scales.shape != biases.shape or scales.shape[0] * group_size != n or scales.dtype != biases.dtype:
        raise ValueError(
            f"{name}: {n} values need {n // group_size} groups of {group_size}, "
            f"scales/biases have {scales.shape}/{biases.shape}"
        )
    return RowMatrix(name, weight, scales, None if symmetric else biases, n, bits, group_size, symmetric)


def matrix(layout: BundleLayout, name: str, quant: Optional[dict]) -> RowMatrix:
    """`row_matrix` for the manifest's quantisation entry of the matrix (None: float rows)."""
    if quant is None:
        return row_matrix(layout, name)
    return row_matrix(layout, name, int(quant["bits"]), int(quant["group_size"]), bool(quant.get("symmetric")))


def is_count(x) -> bool:
    """Whether a manifest value is a count: a non-negative int (not a bool, a float or a string)."""
    return type(x) is int and x >= 0


@dataclass(frozen=True)
class Extent:
    """One component of every unit of a region read in place: unit u's window [offset + u * stride, + nbytes) of
    source file `file` (cut at its end, byte `limit`), read to byte `row_offset` of its cache row; the component's
    `length` bytes lie `at` bytes into it."""

    file: int
    offset: int
    stride: int
    nbytes: int
    row_offset: int
    at: int
    length: int
    limit: int


@dataclass(frozen=True)
class Region:
    """One layer's run of units (bundles) of one layout: in ffn.bin, or in place in the source's files (`extents`)."""

    layer: int
    name: str  # "neurons" (one unit per FFN neuron) or "inputs" (one per input dim, the dip layout)
    offset: int  # byte offset of unit 0 in ffn.bin
    n_units: int
    stride: int
    crc32: int
    extents: tuple = ()  # in place: an Extent per component, in row order (they tile the row's first unit_bytes)

    @property
    def nbytes(self) -> int:
        return self.n_units * self.stride

    @property
    def unit_bytes(self) -> int:
        """A unit's bytes as read: its stride in ffn.bin, its components' windows in place (less where a window is
        cut at its file's end)."""
        return sum(e.nbytes for e in self.extents) if self.extents else self.stride

    def unit_offset(self, unit: int) -> int:
        return self.offset + unit * self.stride

    def layout_over(self, layout: BundleLayout) -> BundleLayout:
        """The layout of this region's rows: `layout` (its name's, shared by every layer), its components where
        this layer's extents put them in place (a component's offset in its aligned window is the source's) and, where
        this layer's is shorter (blocks of another GGML type), its own length."""
        if not self.extents or all(
            c.offset == e.row_offset + e.at and c.nbytes == e.length for c, e in zip(layout.components, self.extents)
        ):
            return layout
        comps = tuple(
            replace(c, offset=e.row_offset + e.at, shape=(c.shape[0], e.length // c.shape[0]))
            if c.nbytes != e.length  # (uint8 GGML blocks of a smaller type in this layer: format/ggml.py)
            else replace(c, offset=e.row_offset + e.at)
            for c, e in zip(layout.components, self.extents)
        )
        return replace(layout, components=comps)

    def unit_offsets(self, units) -> np.ndarray:
        """int64 file offsets of `units` in ffn.bin, each `stride` bytes long."""
        return self.offset + np.asarray(units, dtype=np.int64) * self.stride

    def requests(self, units, dest):
        """(file offsets, lengths, destination offsets) int64 that read `units` to byte offsets `dest`: the one place
        units become bytes. In place, a request per component and unit, at offsets naming their file (FILE_SHIFT)."""
        units, dest = np.asarray(units, dtype=np.int64), np.asarray(dest, dtype=np.int64)
        if not self.extents:
            return self.unit_offsets(units), np.full(len(units), self.stride, dtype=np.int64), dest
        starts = [e.offset + units * e.stride for e in self.extents]
        offsets = np.concatenate([(e.file << FILE_SHIFT) + o for e, o in zip(self.extents, starts)])
        # (a window passing the end of its file is cut there; its component is inside it)
        lengths = np.concatenate([np.minimum(e.nbytes, e.limit - o) for e, o in zip(self.extents, starts)])
        return offsets, lengths, np.concatenate([dest + e.row_offset for e in self.extents])

    def unit_checksums(self, rows, dest) -> np.ndarray:
        """Each unit's CRC-32 in `rows` (a buffer) at byte offsets `dest` (uint32): of its bytes in ffn.bin; in
        place, of its components' CRC-32s (little-endian uint32s, in row order), so the bytes around a component in
        its window do not count."""
        if not self.extents:
            return crc32_at(rows, dest, self.stride)
        dest = np.asarray(dest, dtype=np.int64)
        parts = np.stack([crc32_at(rows, dest + e.row_offset + e.at, e.length) for e in self.extents], 1)
        parts = np.ascontiguousarray(parts, dtype="<u4")
        return crc32_at(parts, np.arange(len(parts)) * parts.shape[1] * 4, parts.shape[1] * 4)
