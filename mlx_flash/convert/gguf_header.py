"""A GGUF file's header, parsed and checked in pure Python (`read_header`): its metadata and tensor infos, every
count, length, type, shape and offset checked against the file before anything reads a tensor."""

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Tuple

import numpy as np

from ..errors import SourceError

GGUF_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_UINT32, _BOOL, _STRING, _ARRAY = 4, 7, 8, 9
MAX_DIMS = 4  # GGML_MAX_DIMS
# the fewest bytes a metadata item (key length, type, a one-byte value) and a tensor info (name length, one
# dimension, type, offset) take: the counts in the header cannot exceed the file's size over these
_MIN_ITEM_BYTES, _MIN_TENSOR_BYTES = 13, 32
# tensor types a GGUF stores as plain numbers (any other is blocks of bytes)
_PLAIN = {
    "F16": np.float16,
    "F32": np.float32,
    "F64": np.float64,
    "I8": np.int8,
    "I16": np.int16,
    "I32": np.int32,
    "I64": np.int64,
}


@dataclass
class _TensorInfo:
    """One tensor of a GGUF file (as gguf.ReaderTensor): its data is a view of the file's memory map."""

    name: str
    shape: Tuple[int, ...]  # GGUF order (fastest-varying dimension first)
    tensor_type: object  # gguf.GGMLQuantizationType
    data_offset: int
    n_bytes: int
    file: np.ndarray

    @property
    def data(self) -> np.ndarray:
        dims = tuple(reversed(self.shape))
        raw = self.file[self.data_offset : self.data_offset + self.n_bytes]
        if self.tensor_type.name in _PLAIN:
            return raw.view(_PLAIN[self.tensor_type.name]).reshape(dims)
        import gguf

        return raw.reshape(gguf.quant_shape_to_byte_shape(dims, self.tensor_type))


class GGUFFile:
    """A GGUF file's metadata (plain Python values) and tensor infos, parsed straight from its memory map (the
    gguf package's reader keeps a numpy view per metadata item: hundreds of MB and seconds for a large vocabulary).

    Every count, length, type code, shape and offset is checked against the file as it is read, as llama.cpp
    checks them (ValueError saying what is wrong): the work is bounded by the file's size, whatever its bytes, and
    what passes can be handed to mx.load, whose gguflib trusts them all (a damaged header is a SIGSEGV there)."""

    def __init__(self, path: Path):
        import gguf

        self.data = np.memmap(path, mode="r")
        self._buf, self._pos = memoryview(self.data), 0
        size = len(self.data)
        if bytes(self._read(4)) != GGUF_MAGIC:
            raise ValueError("GGUF magic invalid")
        version, n_tensors, n_kv = self._unpack("<I"), self._unpack("<Q"), self._unpack("<Q")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported")
        if n_kv > size // _MIN_ITEM_BYTES or n_tensors > size // _MIN_TENSOR_BYTES:
            raise ValueError(f"{n_tensors} tensors and {n_kv} metadata items cannot fit in a {size}-byte file")
        self.fields = {}
        for _ in range(n_kv):
            key, kind = self._string(), self._unpack("<I")
            if key in self.fields:
                raise ValueError(f"metadata key {key!r} appears twice")
            if key == "general.alignment" and kind != _UINT32:  # (what gguflib and llama.cpp read)
                raise ValueError(f"general.alignment has value type {kind}, not uint32")
            self.fields[key] = self._value(kind)
        infos = {}
        for _ in range(n_tensors):
            name, n_dims = self._string(), self._unpack("<I")
            if not 1 <= n_dims <= MAX_DIMS:
                raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
            shape = tuple(self._unpack("<Q") for _ in range(n_dims))
            code, offset = self._unpack("<I"), self._unpack("<Q")
            try:
                qtype = gguf.GGMLQuantizationType(code)
            except ValueError:
                raise ValueError(f"tensor {name!r} has unknown type {code}") from None
            if name in infos:
                raise ValueError(f"tensor {name!r} appears twice")
            infos[name] = shape, qtype, offset
        align = self.fields.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
        if align <= 0 or align & (align - 1):
            raise ValueError(f"invalid alignment {align}")
        start = -(-self._pos // align) * align
        self.tensors = []
        for name, (shape, qtype, offset) in infos.items():
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            if min(shape) < 1 or shape[0] % block:
                raise ValueError(f"tensor {name!r} has shape {shape}, not rows of whole {qtype.name} blocks")
            n_bytes = math.prod(shape) // block * type_size
            if offset % align:
                raise ValueError(f"tensor {name!r} has offset {offset}, not a multiple of the alignment {align}")
            if start + offset + n_bytes > size:
                raise ValueError(f"tensor {name!r} runs past the end of the file (truncated?)")
            self.tensors.append(_TensorInfo(name, shape, qtype, start + offset, n_bytes, self.data))
        del self._buf

    def _read(self, n: int) -> memoryview:
        if self._pos + n > len(self._buf):
            raise ValueError(f"unexpected end of file in the header, at byte {self._pos} (truncated?)")
        self._pos += n
        return self._buf[self._pos - n : self._pos]

    def _unpack(self, fmt: str):
        return struct.unpack(fmt, self._read(struct.calcsize(fmt)))[0]

    def _string(self) -> str:
        at = self._pos
        try:
            return str(self._read(self._unpack("<Q")), "utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"the string at byte {at} is not UTF-8") from None

    def _value(self, kind: int):
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            kind, n = self._unpack("<I"), self._unpack("<Q")
            if kind == _STRING:
                if 8 * n > len(self._buf) - self._pos:  # (each string takes at least its 8-byte length)
                    raise ValueError(f"an array of {n} strings at byte {self._pos} cannot fit in the file")
                return [self._string() for _ in range(n)]
            if kind not in _SCALARS:  # arrays of arrays too: neither llama.cpp nor mx.load reads them
                raise ValueError(f"unsupported GGUF array element type {kind}")
            dtype = np.dtype(_SCALARS[kind] if kind != _BOOL else np.uint8)
            values = np.frombuffer(self._read(n * dtype.itemsize), dtype)
            return (values != 0 if kind == _BOOL else values).tolist()
        if kind not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {kind}")
        return self._unpack(_SCALARS[kind])


def read_header(path: Path) -> GGUFFile:
    """The GGUF's header, checked (GGUFFile); SourceError saying what is wrong."""
    try:
        return GGUFFile(path)
    except (ValueError, OSError) as e:
        raise SourceError(f"{path}: not a valid GGUF file: {e}") from e
