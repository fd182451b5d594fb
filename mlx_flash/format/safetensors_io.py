"""Safetensors files written one tensor at a time, byte for byte what `mx.save_safetensors` writes for the same dict.

`mx.save_safetensors` evaluates and holds every array of its dict at once. A `TensorSpool` takes the arrays one
by one (each evaluated, appended to a scratch file and released by the caller), then `save` writes the file:
the header `mx.save_safetensors` would write (JSON with sorted keys) and the data in its order (that of its C++
hash map, found by saving one byte per name), copied from the scratch file in chunks.
"""

import hashlib
import json
import os
import struct
import tempfile
from pathlib import Path
from typing import Dict, Iterable, List, Optional

import mlx.core as mx
import numpy as np

DTYPES = {
    mx.bool_: "BOOL",
    mx.uint8: "U8",
    mx.int8: "I8",
    mx.uint16: "U16",
    mx.int16: "I16",
    mx.uint32: "U32",
    mx.int32: "I32",
    mx.uint64: "U64",
    mx.int64: "I64",
    mx.float16: "F16",
    mx.bfloat16: "BF16",
    mx.float32: "F32",
    mx.complex64: "C64",
}
_NP_DTYPES = {
    "BOOL": np.bool_,
    "U8": np.uint8,
    "I8": np.int8,
    "U16": np.uint16,
    "I16": np.int16,
    "U32": np.uint32,
    "I32": np.int32,
    "U64": np.uint64,
    "I64": np.int64,
    "F16": np.float16,
    "BF16": np.uint16,
    "F32": np.float32,
    "C64": np.complex64,
}
CHUNK = 1 << 24


def read_header(path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > os.fstat(f.fileno()).st_size - 8:  # (a damaged file's length would be read as it says)
            raise ValueError(f"header length {n} exceeds the file")
        return json.loads(f.read(n))


def data_order(names: List[str]) -> List[str]:
    """The order in which `mx.save_safetensors` writes the data of a dict with these keys, inserted in this order."""
    with tempfile.TemporaryDirectory() as d:
        probe = os.path.join(d, "order.safetensors")
        mx.save_safetensors(probe, {k: mx.zeros((1,), mx.uint8) for k in names})
        header = read_header(probe)
    return sorted(names, key=lambda k: header[k]["data_offsets"][0])


def tensor_bytes(a: mx.array) -> np.ndarray:
    """The row-major bytes of `a` (evaluated), as a contiguous numpy array (a view when `a` is contiguous)."""
    mx.eval(a)
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.ascontiguousarray(np.asarray(a))


class TensorSpool:
    """Arrays appended to a scratch file as they are added, then saved as one safetensors file."""

    def __init__(self, scratch):
        self.scratch = Path(scratch)
        self._f = open(self.scratch, "w+b")
        self.entries: Dict[str, tuple] = {}  # name -> (safetensors dtype, shape, offset in the scratch file, bytes)
        self.nbytes = 0

    def __len__(self):
        return len(self.entries)

    def add(self, name: str, a: mx.array) -> None:
        data = tensor_bytes(a)
        self._f.write(memoryview(data).cast("B"))
        self.entries[name] = (DTYPES[a.dtype], list(a.shape), self.nbytes, data.nbytes)
        self.nbytes += data.nbytes

    def array(self, name: str) -> mx.array:
        """A copy of one spooled array, read back from the scratch file."""
        dtype, shape, offset, n = self.entries[name]
        self._f.flush()
        self._f.seek(offset)
        a = mx.array(np.frombuffer(self._f.read(n), dtype=_NP_DTYPES[dtype]).reshape(shape))
        self._f.seek(0, os.SEEK_END)
        return a.view(mx.bfloat16) if dtype == "BF16" else a

    def save(
        self,
        path,
        names: Optional[Iterable[str]] = None,
        metadata: Optional[dict] = None,
        progress=None,
        checksum: bool = False,
    ) -> Optional[str]:
        """Write `names` (default: all, in the order added) as the safetensors file `path`, as
        `mx.save_safetensors(path, {name: array}, metadata)` would; returns the file's sha256 if `checksum`.
        `progress`: a tqdm bar updated with the bytes written. The scratch file is removed."""
        names = list(self.entries if names is None else names)
        header, offset = {"__metadata__": metadata}, 0
        order = data_order(names)
        for k in order:
            dtype, shape, _, n = self.entries[k]
            header[k] = {"data_offsets": [offset, offset + n], "dtype": dtype, "shape": shape}
            offset += n
        text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
        sha = hashlib.sha256() if checksum else None
        self._f.flush()
        with open(path, "wb") as out:
            for b in (struct.pack("<Q", len(text)), text):
                out.write(b)
                if sha is not None:
                    sha.update(b)
            for k in order:
                _, _, start, n = self.entries[k]
                self._f.seek(start)
                while n:
                    chunk = self._f.read(min(n, CHUNK))
                    out.write(chunk)
                    if sha is not None:
                        sha.update(chunk)
                    n -= len(chunk)
                    if progress is not None:
                        progress.update(len(chunk))
        self.close()
        return None if sha is None else sha.hexdigest()

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()
        self.scratch.unlink(missing_ok=True)
