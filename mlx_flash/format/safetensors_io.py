"""Safetensors files written one tensor at a time, byte for byte what `mx.save_safetensors` writes for the same dict
(or, written in place, what any safetensors reader reads alike).

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

    def __init__(
        self, scratch, reserve: Optional[Dict[str, mx.array]] = None, metadata: Optional[dict] = None, room: int = 0
    ):
        """`reserve`: the arrays (lazy: only dtypes and shapes are read) to be added, in their order, room for
        whose header (with `metadata`) `finish` leaves at the start of the scratch file; or `room` bytes left there
        for a header not known yet (one that outgrows it is written by `save`, a copy)."""
        self.scratch, self.metadata = Path(scratch), metadata
        self._f = open(self.scratch, "w+b")
        self.entries: Dict[str, tuple] = {}  # name -> (safetensors dtype, shape, offset in the scratch file, bytes)
        self.start = room
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
        if 8 + len(text) > self.start:  # (only with `room`: `reserve` fits its header)
            return self.save(path, keep, self.metadata, progress, checksum=sha256)
        self._f.seek(0)
        self._f.write(struct.pack("<Q", self.start - 8) + text + b" " * (self.start - 8 - len(text)))
        self._f.close()
        os.replace(self.scratch, path)
        return file_sha256(path, progress) if sha256 else None

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()
        self.scratch.unlink(missing_ok=True)


def hole_file(path, sizes: Dict[str, tuple], metadata: Optional[dict] = None) -> None:
    """A safetensors file of tensors {name: (dtype, shape, bytes)} whose data are not written yet: its header and
    then a hole (a sparse file, whose blocks are allocated as the data are written into it, `fill_hole`)."""
    text = _header(sizes, list(sizes), metadata)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(8 + len(text) + sum(n for _, _, n in sizes.values()))


def fill_hole(f, header: dict, name: str, a: mx.array) -> None:
    """`a` written as tensor `name` of the file `f` (opened for writing) whose header is `header` (`read_header`);
    ValueError unless `a` is what the header says."""
    entry = header[name]
    start, end = entry["data_offsets"]
    if DTYPES[a.dtype] != entry["dtype"] or list(a.shape) != entry["shape"] or a.nbytes != end - start:
        raise ValueError(f"{name}: {a.dtype} {a.shape}, where the file has {entry['dtype']} {entry['shape']}")
    f.seek(0)
    (n,) = struct.unpack("<Q", f.read(8))
    f.seek(8 + n + start)
    f.write(memoryview(tensor_bytes(a)).cast("B"))


class ShardWriter:
    """Safetensors shards of about `shard_bytes`, or of one `group` of arrays each, each array spooled as it is added
    (memory: one array) into its shard's own file, whose header goes in the room left at its start
    (`TensorSpool.finish`): the data are written once. `add_file`: a shard written otherwise (`hole_file`). `close`
    names them model.safetensors or model-NNNNN-of-NNNNN.safetensors (an index beside several), as mlx-lm's loader
    finds them."""

    def __init__(self, out_dir: Path, shard_bytes: int, room: int = 4 << 10):
        self.out_dir, self.shard_bytes, self.room = Path(out_dir), shard_bytes, room
        self.spools: Dict[object, TensorSpool] = {}  # group -> its shard being written
        self.set, self.made = None, 0
        self.shards: List[List[str]] = []  # tensor names of each written shard
        self.files: List[Path] = []

    def add(self, name: str, arr, group=None) -> None:
        """`group`: None, or (set, part): a shard holds one group's arrays; the groups of a set are written together
        (a layer's FFN and the rest of it), and an array of another set ends them."""
        if group is not None and group[0] != self.set:
            self.flush()
            self.set = group[0]
        spool = self.spools.get(group)
        if spool is not None and spool.nbytes + arr.nbytes > self.shard_bytes:
            self._end(group)
            spool = None
        if spool is None:
            self.made += 1
            scratch = self.out_dir / f".tmp-model-{self.made:05d}.spool"
            spool = self.spools[group] = TensorSpool(scratch, metadata={"format": "mlx"}, room=self.room)
        spool.add(name, arr)

    def add_file(self, path: Path, names: List[str]) -> None:
        self.flush()
        self.files.append(path)
        self.shards.append(sorted(names))

    def _end(self, group) -> None:
        spool = self.spools.pop(group)
        f = spool.scratch.with_suffix(".safetensors")  # (not matched by model*.safetensors)
        self.shards.append(sorted(spool.entries))
        spool.finish(f, list(spool.entries), sha256=False)
        self.files.append(f)

    def flush(self) -> None:
        for group in list(self.spools):
            self._end(group)

    def close(self) -> List[Path]:
        """The shards' paths, in the order written."""
        self.flush()
        n = len(self.files)
        names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        weight_map, total, paths = {}, 0, []
        for f, name, keys in zip(self.files, names, self.shards):
            total += f.stat().st_size
            paths.append(f.replace(self.out_dir / name))
            weight_map.update({k: name for k in keys})
        if n > 1:
            with open(self.out_dir / "model.safetensors.index.json", "w") as fh:
                json.dump(
                    {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, fh, indent=2
                )
        return paths
