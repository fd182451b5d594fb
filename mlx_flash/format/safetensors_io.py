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


def file_sha256(path, progress=None) -> str:
    """A file's sha256, read in chunks (`progress`: a tqdm bar updated with the bytes read)."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            sha.update(chunk)
            if progress is not None:
                progress.update(len(chunk))
    return sha.hexdigest()


def _header(sizes: Dict[str, tuple], order: List[str], metadata: dict) -> bytes:
    """A safetensors header (sorted keys, as mx writes it) of tensors {name: (dtype, shape, bytes)} whose data lie
    in `order`."""
    header, offset = {"__metadata__": metadata}, 0
    for k in order:
        dtype, shape, n = sizes[k]
        header[k] = {"data_offsets": [offset, offset + n], "dtype": dtype, "shape": shape}
        offset += n
    return json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


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
    """Arrays appended to a scratch file as they are added, then saved as one safetensors file (`save`), or
    made one in place (`finish`: the scratch file becomes it, so the data are on disk once)."""

    def __init__(self, scratch, reserve: Optional[Dict[str, mx.array]] = None, metadata: Optional[dict] = None):
        """`reserve`: the arrays (lazy: only dtypes and shapes are read) to be added, in their order, room for
        whose header (with `metadata`) `finish` leaves at the start of the scratch file."""
        self.scratch, self.metadata = Path(scratch), metadata
        self._f = open(self.scratch, "w+b")
        self.entries: Dict[str, tuple] = {}  # name -> (safetensors dtype, shape, offset in the scratch file, bytes)
        self.start = 0
        if reserve is not None:
            sizes = {k: (DTYPES[v.dtype], list(v.shape), v.nbytes) for k, v in reserve.items()}
            self.start = 8 + len(_header(sizes, list(sizes), metadata))
            self._f.truncate(self.start)
            self._f.seek(self.start)
        self.nbytes = self.start

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
        order = data_order(names)
        text = _header({k: (e[0], e[1], e[3]) for k, e in self.entries.items()}, order, metadata)
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

    def finish(self, path, names: Iterable[str], progress=None, sha256: bool = True) -> Optional[str]:
        """The scratch file made the safetensors file `path` of `names` (all added, in order, those left out after
        the first removed by moving the rest back), its header in the room `reserve` left, padded with spaces;
        returns its sha256 if asked (read back, `progress` updated). Its data are in the order added: any
        safetensors reader's, not byte for byte what `mx.save_safetensors` writes."""
        names = set(names)
        keep = [k for k in self.entries if k in names]
        at = self.start
        for k in list(self.entries):  # (in the order added)
            dtype, shape, offset, n = self.entries.pop(k)
            if k not in names:
                continue
            if offset != at:  # after a removed tensor: moved back over it
                for done in range(0, n, CHUNK):
                    self._f.seek(offset + done)
                    chunk = self._f.read(min(CHUNK, n - done))
                    self._f.seek(at + done)
                    self._f.write(chunk)
            self.entries[k] = (dtype, shape, at, n)
            at += n
        self._f.truncate(at)
        text = _header({k: (e[0], e[1], e[3]) for k, e in self.entries.items()}, keep, self.metadata)
        if 8 + len(text) > self.start:
            raise ValueError("the header outgrew the room reserved for it")
        self._f.seek(0)
        self._f.write(struct.pack("<Q", self.start - 8) + text + b" " * (self.start - 8 - len(text)))
        self._f.close()
        os.replace(self.scratch, path)
        return file_sha256(path, progress) if sha256 else None

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()
        self.scratch.unlink(missing_ok=True)
