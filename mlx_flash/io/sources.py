"""Several files read as one: the reader of units read in place from a model's source files (format v5)."""

import errno as _errno
from pathlib import Path

import numpy as np

from ..errors import ReadError
from .reader import DEFAULT_THREADS, as_i64, open_reader

# Units read in place (format v5) have their components in a model's source files: file i's byte o is read at
# offset (i << FILE_SHIFT) + o, so one batch of requests names bytes of any of them (format.layout.Region.requests)
FILE_SHIFT = 44


class SourceReader:
    """Readers of several files behind one reader interface: file i's byte o is offset (i << FILE_SHIFT) + o
    (format.layout.Region.requests), so a batch may read from any of them. For units read in place from a model's
    source files (format v5); each file gets its own pool of `threads` (opened lazily: a file no unit reads is never
    opened)."""

    native = property(lambda self: all(r.native for r in self._open()))

    def __init__(self, paths, **kw):
        self.paths, self._kw, self._readers = [Path(p) for p in paths], kw, {}
        self.threads = kw.get("threads", DEFAULT_THREADS)
        self.alignment = self._reader(0).alignment  # (every file of a model is on one filesystem)

    def _reader(self, i: int):
        if i not in self._readers:
            if not 0 <= i < len(self.paths):
                raise ReadError(_errno.EINVAL, f"no source file {i} (the manifest names {len(self.paths)})")
            self._readers[i] = open_reader(self.paths[i], **self._kw)
        return self._readers[i]

    def _open(self):
        return list(self._readers.values())

    def submit(self, dest, file_offsets, lengths, dest_offsets, *, coalesce: bool = True):
        offsets, lengths, dest_offsets = as_i64(file_offsets), as_i64(lengths), as_i64(dest_offsets)
        files = offsets >> FILE_SHIFT
        handles = []
        for i in np.unique(files).tolist():
            mine = files == i
            r = self._reader(i)
            local = offsets[mine] - (i << FILE_SHIFT)
            handles.append((r, r.submit(dest, local, lengths[mine], dest_offsets[mine], coalesce=coalesce)))
        return handles

    def wait(self, handles) -> int:
        """Wait for every file's batch (all of them, even after one fails: none is left writing into `dest`)."""
        total, error = 0, None
        for r, h in handles:
            try:
                total += r.wait(h)
            except ReadError as e:
                error = error or e
        if error is not None:
            raise error
        return total

    def read(self, dest, file_offsets, lengths, dest_offsets, *, coalesce: bool = True) -> int:
        return self.wait(self.submit(dest, file_offsets, lengths, dest_offsets, coalesce=coalesce))

    def stats(self) -> dict:
        out = {}
        for r in self._open():
            for k, v in r.stats().items():
                out[k] = out.get(k, 0) + v
        return out

    def reset_stats(self) -> None:
        for r in self._open():
            r.reset_stats()

    def close(self) -> None:
        for r in self._open():
            r.close()

    closed = property(lambda self: all(r.closed for r in self._open()))
    direct = property(lambda self: self._reader(0).direct)
    path = property(lambda self: self.paths[0])

    @property
    def max_gap_bytes(self) -> int:
        return self._reader(0).max_gap_bytes

    @max_gap_bytes.setter
    def max_gap_bytes(self, v: int) -> None:
        self._kw["max_gap_bytes"] = v
        for r in self._open():
            r.max_gap_bytes = v

    @property
    def max_request_bytes(self) -> int:
        return self._reader(0).max_request_bytes

    @max_request_bytes.setter
    def max_request_bytes(self, v: int) -> None:
        self._kw["max_request_bytes"] = v
        for r in self._open():
            r.max_request_bytes = v

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self):
        return f"SourceReader({len(self.paths)} files from {self.paths[0].parent})"
