"""Where bytes come off the disk: batched, parallel, uncached reads into MLX memory.

    reader = open_reader("model/ffn.bin")                   # 32 threads, O_DIRECT
    rows = aligned_rows(capacity, stride, reader.alignment)  # cache matrix, rows aligned
    reader.read(rows.base, file_offsets, lengths, rows.dest_offsets(slots))  # one call per batch
    h = reader.submit(rows.base, ...); ...compute...; reader.wait(h)
    reader.stats()   # bytes_read, bytes_requested, requests (syscalls), reads, batches, busy_ns

`file_offsets`, `lengths` and `dest_offsets` are equal-length int64 arrays (anything
`np.asarray(..., np.int64)` accepts); read i copies file[file_offsets[i] : +lengths[i]] to
dest[dest_offsets[i] : +lengths[i]] (byte offsets into the destination buffer). The
destination is any writable C-contiguous buffer: numpy array, bytearray, or an evaluated
`mx.array` (its memory is written in place; MLX sees the bytes without a copy).

Two engines with one interface and the same errors:
- `NativeReader`: the C extension `mlx_flash._pread_pool` (pthreads, GIL released,
  O_DIRECT on Linux / F_NOCACHE on macOS, preadv coalescing, per-thread aligned bounce
  buffers for unaligned requests).
- `PythonReader`: os.preadv in a ThreadPoolExecutor; used only when the extension is missing.

Every failure (short read past the end of the file, EIO, EBADF, a destination too small,
negative or mismatched index arrays, a closed reader) raises `ReadError` (an OSError) whose
message carries path, offset and length; `err.offset`/`err.length` hold them too.

O_DIRECT needs the file offset, length and destination address to be multiples of the
alignment (asked from the filesystem with statx: 512 on this project's disk; 4096 when it
does not say; `reader.alignment` tells). MLX CPU arrays start 24 bytes past a page boundary, so the cache
must be over-allocated: `aligned_buffer`/`aligned_rows` do that. Unaligned requests are
still correct (served through a bounce buffer), only slower.

MLX views: a basic slice (`a[i:j]`, `a[i:j].reshape(...)`) of an evaluated array shares
its memory, but an integer index (`a2d[3]`) is a copy, so writes into its buffer are lost.
Pass the base array and byte offsets (what `aligned_rows` returns) to be safe.
"""

import errno as _errno
import itertools
import mmap
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ..errors import ReadError

try:  # the native engine; missing when the package was installed without a C compiler
    from .. import _pread_pool as _native
except ImportError:  # pragma: no cover - exercised by forcing native=False in tests
    _native = None

# Defaults measured by `python -m mlx_flash.tools.bench_io` on the project machine (BENCHMARKS.md,
# "## I/O engine"; 2-core KVM, virtio disk): 32 threads gave the best throughput at every
# read size from 4 KiB to 1 MiB (geo-mean 0.96 of the per-size best, 16 threads 0.89, 8
# threads 0.76); the gap worth reading and discarding to merge two requests, from the
# measured cost-per-request curve (max_gap_from_measurements), was 8-16 KiB over three runs.
# The coalescing test agrees: 4 KiB holes filled read 1.6x faster, 16 and 32 KiB holes slower.
DEFAULT_THREADS = 32
DEFAULT_ALIGNMENT = 4096
DEFAULT_MAX_GAP_BYTES = 12 * 1024
DEFAULT_MAX_REQUEST_BYTES = 1 << 20
DEFAULT_BOUNCE_BYTES = 1 << 20  # per thread, for unaligned runs (memory touched only as far as a run needs it)
_F_NOCACHE = 48  # fcntl.h on macOS


def dio_alignment(path) -> int:
    """The O_DIRECT alignment the filesystem asks for `path` (Linux >= 6.1, statx
    STATX_DIOALIGN: max of the memory and file-offset alignments), 0 when unknown."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        import ctypes
        import struct

        libc = ctypes.CDLL(None, use_errno=True)
        buf = ctypes.create_string_buffer(256)  # struct statx
        fd = os.open(os.fspath(path), os.O_RDONLY)
        try:
            rc = libc.statx(fd, b"", 0x1000, 0x2000, buf)  # AT_EMPTY_PATH, STATX_DIOALIGN
        finally:
            os.close(fd)
        mask = struct.unpack_from("I", buf, 0)[0]
        mem, off = struct.unpack_from("II", buf, 152)  # stx_dio_mem_align, stx_dio_offset_align
        a = max(mem, off)
        if rc != 0 or not mask & 0x2000 or off == 0 or a & (a - 1):
            return 0
        return a
    except (OSError, AttributeError):
        return 0


def have_native() -> bool:
    """True when the C extension `mlx_flash._pread_pool` is importable."""
    return _native is not None


# --------------------------------------------------------------------------------------
# Aligned MLX buffers


def address_of(buf) -> int:
    """Address of the first byte of a buffer-protocol object (mx.array, numpy, bytearray)."""
    mv = memoryview(buf)
    if mv.nbytes == 0:
        return 0
    return np.frombuffer(mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv, np.uint8).ctypes.data


def aligned_span(offset: int, length: int, alignment: int):
    """(start, end): the smallest range of whole `alignment` blocks that holds [offset, offset + length)."""
    return offset // alignment * alignment, -(-(offset + length) // alignment) * alignment


def aligned_buffer(nbytes: int, alignment: int = DEFAULT_ALIGNMENT, dtype=mx.uint8) -> Tuple[mx.array, int]:
    """An evaluated 1-D mx.array `base` and the byte offset of its first `alignment`-aligned
    byte, with at least `nbytes` bytes from there on. Read into `base` at dest offsets
    `offset + k` (the base array itself is what you pass to `read`)."""
    itemsize = dtype.size
    if alignment % itemsize:
        raise ValueError(f"alignment {alignment} is not a multiple of the item size {itemsize}")
    n = (nbytes + alignment + itemsize - 1) // itemsize
    base = mx.zeros((max(n, 1),), dtype=dtype)
    mx.eval(base)
    addr = address_of(base)
    offset = (-addr) % alignment
    if offset % itemsize:
        raise RuntimeError(f"MLX buffer at {addr:#x} is not aligned to its item size {itemsize}")
    return base, offset


class AlignedBuffer:
    """An evaluated uint8 mx.array whose usable bytes start at an `alignment` boundary (for O_DIRECT)."""

    def __init__(self, nbytes: int, alignment: int):
        self.buffer, self.base_offset = aligned_buffer(nbytes, alignment)
        self.nbytes = nbytes

    def host_bytes(self) -> np.ndarray:
        """The whole buffer as a numpy view (byte 0 is the buffer's, not base_offset's)."""
        return np.asarray(memoryview(self.buffer))


@dataclass
class AlignedRows:
    """A [rows, row_bytes // itemsize] matrix inside `base` whose row 0 starts aligned.

    `view` is a basic slice + reshape of `base` (it shares base's memory: checked at
    creation). Row r lives at byte `offset + r * row_bytes` of `base`; `dest_offsets(rows)`
    gives those offsets for `read`."""

    base: mx.array
    offset: int
    row_bytes: int
    view: mx.array

    def dest_offsets(self, rows) -> np.ndarray:
        return self.offset + np.asarray(rows, dtype=np.int64) * self.row_bytes


def aligned_rows(rows: int, row_bytes: int, alignment: int = DEFAULT_ALIGNMENT, dtype=mx.uint8) -> AlignedRows:
    """Allocate an evaluated cache matrix [rows, row_bytes // itemsize] of `dtype` whose row 0
    starts at an `alignment` boundary (every row is aligned when row_bytes is a multiple of
    the alignment, as bundle strides are). Read into `.base` at `.dest_offsets(slots)`."""
    itemsize = dtype.size
    if row_bytes % itemsize:
        raise ValueError(f"row_bytes {row_bytes} is not a multiple of the item size {itemsize}")
    base, offset = aligned_buffer(rows * row_bytes, alignment, dtype)
    start = offset // itemsize
    view = base[start : start + rows * row_bytes // itemsize].reshape(rows, row_bytes // itemsize)
    mx.eval(view)
    if rows * row_bytes and address_of(view) != address_of(base) + offset:
        raise RuntimeError("MLX copied the aligned view instead of sharing the base buffer")
    return AlignedRows(base, offset, row_bytes, view)


# --------------------------------------------------------------------------------------
# Gap policy


def max_gap_from_measurements(
    sizes: Sequence[int],
    seconds_per_request: Sequence[float],
    request_bytes: Optional[int] = None,
    alignment: int = DEFAULT_ALIGNMENT,
) -> int:
    """The largest gap worth filling, from a measured cost-per-request-vs-size curve.

    Two requests a, b separated by a gap g are merged (the gap is read and thrown away)
    when cost(a + g + b) < cost(a) + cost(b). `seconds_per_request[i]` is the device time of
    one request of `sizes[i]` bytes under the load of interest, e.g. threads / IOPS or
    1 / IOPS at the runtime's thread count (any constant factor cancels out).

    Without `request_bytes`: fit cost(s) = t0 + s / B (least squares); the rule becomes
    g < t0 * B, independent of a and b. With `request_bytes` = a = b (the bundle size):
    solve cost(2a + g) < 2 cost(a) on the measured curve, linearly interpolated (and
    extrapolated from the last two points). Rounded down to the alignment; >= 0."""
    s = np.asarray(sizes, dtype=np.float64)
    t = np.asarray(seconds_per_request, dtype=np.float64)
    if s.shape != t.shape or s.size < 2:
        raise ValueError("need at least two (size, seconds) measurements of equal length")
    order = np.argsort(s)
    s, t = s[order], t[order]
    if request_bytes is None:
        slope, t0 = np.polyfit(s, t, 1)
        if slope <= 0:
            return 0
        gap = t0 / slope
    else:
        a = float(request_bytes)

        def cost(x):
            if x <= s[-1]:
                return float(np.interp(x, s, t))
            return float(t[-1] + (x - s[-1]) * (t[-1] - t[-2]) / (s[-1] - s[-2]))

        budget = 2 * cost(a)
        lo, hi = 0.0, max(s[-1] * 4, 4 * a)
        if cost(2 * a) >= budget:
            return 0
        for _ in range(60):  # bisection: cost is nondecreasing in practice
            mid = (lo + hi) / 2
            if cost(2 * a + mid) < budget:
                lo = mid
            else:
                hi = mid
        gap = lo
    if not np.isfinite(gap) or gap <= 0:
        return 0
    return int(gap) // alignment * alignment


# --------------------------------------------------------------------------------------
# Shared helpers


def _read_error(path, err: int, offset: int, length: int, what: str) -> ReadError:
    e = ReadError(err or _errno.EIO, f"{what}: path={path}, offset={offset}, length={length}", str(path))
    e.offset, e.length = int(offset), int(length)
    return e


def as_i64(x) -> np.ndarray:
    if isinstance(x, np.ndarray) and x.dtype == np.int64 and x.flags.c_contiguous:
        return x
    return np.ascontiguousarray(x, dtype=np.int64).reshape(-1)


class NativeReader:
    """The C pool (`mlx_flash._pread_pool.Pool`) behind the reader interface."""

    native = True

    def __init__(
        self,
        path,
        threads: int = DEFAULT_THREADS,
        direct: bool = True,
        alignment: Optional[int] = None,
        max_gap_bytes: int = DEFAULT_MAX_GAP_BYTES,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        bounce_bytes: int = DEFAULT_BOUNCE_BYTES,
    ):
        if _native is None:
            raise ImportError("mlx_flash._pread_pool is not built (pip install -e . with a C compiler)")
        self._pool = _native.Pool(
            os.fspath(path),
            threads=threads,
            direct=direct,
            alignment=alignment or 0,
            max_gap=max_gap_bytes,
            max_request=max_request_bytes,
            bounce=bounce_bytes,
        )

    def read(self, dest, file_offsets, lengths, dest_offsets, *, coalesce: bool = True) -> int:
        """Read every request into `dest`; returns the bytes requested. Raises ReadError."""
        return self._pool.read(dest, as_i64(file_offsets), as_i64(lengths), as_i64(dest_offsets), coalesce=coalesce)

    def submit(self, dest, file_offsets, lengths, dest_offsets, *, coalesce: bool = True):
        """Start a batch; returns a handle for `wait` (it keeps `dest` alive)."""
        return self._pool.submit(dest, as_i64(file_offsets), as_i64(lengths), as_i64(dest_offsets), coalesce=coalesce)

    def wait(self, handle) -> int:
        """Block until the batch is done; returns its bytes requested. Raises ReadError."""
        return self._pool.wait(handle)

    def close(self) -> None:
        """Finish queued batches, join the threads, close the file. Idempotent."""
        self._pool.close()

    def stats(self) -> dict:
        """Cumulative counters: bytes_read (from the file, incl. gaps and bounce supersets),
        bytes_requested, requests (read syscalls after coalescing), reads, batches, busy_ns (time with
        a batch in flight: bytes_read / busy_ns is the pool's throughput while it had work)."""
        return self._pool.stats()

    def reset_stats(self) -> None:
        self._pool.reset_stats()

    path = property(lambda self: self._pool.path)
    threads = property(lambda self: self._pool.threads)
    direct = property(lambda self: self._pool.direct)
    alignment = property(lambda self: self._pool.alignment)
    closed = property(lambda self: self._pool.closed)

    @property
    def max_gap_bytes(self) -> int:
        return self._pool.max_gap

    @max_gap_bytes.setter
    def max_gap_bytes(self, v: int) -> None:
        self._pool.max_gap = int(v)

    @property
    def max_request_bytes(self) -> int:
        return self._pool.max_request

    @max_request_bytes.setter
    def max_request_bytes(self, v: int) -> None:
        self._pool.max_request = int(v)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self):
        return f"NativeReader({self.path!r}, threads={self.threads}, direct={self.direct})"


# --------------------------------------------------------------------------------------
# Pure-Python fallback


class _PyHandle:
    """A batch in flight (PythonReader.submit); keeps the destination alive until waited."""

    __slots__ = ("futures", "keep", "nbytes", "state")

    def __init__(self, futures, keep, nbytes, state):
        self.futures, self.keep, self.nbytes, self.state = futures, keep, nbytes, state

    @property
    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def wait(self) -> int:
        for f in self.futures:
            f.result()
        if self.state["error"] is not None:
            raise self.state["error"]
        return self.nbytes


def _aligned_mmap(nbytes: int) -> mmap.mmap:
    return mmap.mmap(-1, max(nbytes, mmap.PAGESIZE))  # anonymous maps are page aligned


class PythonReader:
    """os.preadv in a ThreadPoolExecutor: the same interface, results and errors as
    NativeReader (slower per request; used only when the C extension is missing)."""

    native = False

    def __init__(
        self,
        path,
        threads: int = DEFAULT_THREADS,
        direct: bool = True,
        alignment: Optional[int] = None,
        max_gap_bytes: int = DEFAULT_MAX_GAP_BYTES,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        bounce_bytes: int = DEFAULT_BOUNCE_BYTES,
    ):
        if not 1 <= threads <= 1024:
            raise ValueError(f"threads must be in 1..1024, got {threads}")
        if alignment is not None and (alignment < 0 or alignment & (alignment - 1)):
            raise ValueError(f"alignment must be a power of two (0/None: ask the filesystem), got {alignment}")
        if max_gap_bytes < 0 or max_request_bytes < 0:
            raise ValueError("max_gap_bytes and max_request_bytes must be >= 0")
        self.path = os.fsdecode(os.fspath(path))
        self.direct = bool(direct)
        flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
        o_direct = getattr(os, "O_DIRECT", 0)
        if direct and o_direct:
            flags |= o_direct
        try:
            self._fd = os.open(self.path, flags)
            if not (direct and o_direct):
                self.alignment = 1  # cached reads and F_NOCACHE have no alignment rule
            else:
                self.alignment = alignment or dio_alignment(self.path) or DEFAULT_ALIGNMENT
            if direct and not o_direct and sys.platform == "darwin":  # untested here (Linux CI)
                import fcntl

                fcntl.fcntl(self._fd, getattr(fcntl, "F_NOCACHE", _F_NOCACHE), 1)
        except OSError as e:
            mode = "uncached (O_DIRECT/F_NOCACHE)" if direct else "cached"
            raise _read_error(self.path, e.errno, 0, 0, f"cannot open for {mode} reads: {e.strerror}") from e
        if bounce_bytes < 4096:
            raise ValueError(f"bounce_bytes must be >= 4096, got {bounce_bytes}")
        self.threads = threads
        self._bounce_bytes = -(-int(bounce_bytes) // 4096) * 4096
        self._max_gap = int(max_gap_bytes)
        self._max_request = self._round_request(int(max_request_bytes))
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="mlx_flash-read")
        self._local = threading.local()
        self._lock = threading.Lock()
        self._closed = False
        self._stats = dict(bytes_read=0, bytes_requested=0, requests=0, reads=0, batches=0, busy_ns=0)
        self._inflight, self._busy_since = 0, 0  # as the native pool: time with a batch in flight

    def _round_request(self, v: int) -> int:
        a = self.alignment
        return (v + a - 1) // a * a if v > 0 else 0

    @property
    def max_gap_bytes(self) -> int:
        return self._max_gap

    @max_gap_bytes.setter
    def max_gap_bytes(self, v: int) -> None:
        if v < 0:
            raise ValueError("max_gap must be >= 0")
        self._max_gap = int(v)

    @property
    def max_request_bytes(self) -> int:
        return self._max_request

    @max_request_bytes.setter
    def max_request_bytes(self, v: int) -> None:
        if v < 0:
            raise ValueError("max_request must be >= 0 (0: no limit)")
        self._max_request = self._round_request(int(v))

    @property
    def closed(self) -> bool:
        return self._closed

    # ---- planning (the same algorithm as kernels/pread_pool.c: batch_plan) ----

    def _plan(self, dest, file_offsets, lengths, dest_offsets, coalesce):
        if self._closed:
            raise _read_error(self.path, _errno.EBADF, 0, 0, "read on a closed pool")
        mv = memoryview(dest)
        if mv.readonly:
            raise TypeError("dest must be a writable buffer")
        if not mv.contiguous:
            raise BufferError("dest must be a contiguous buffer")
        if mv.ndim != 1 or mv.format != "B":
            mv = mv.cast("B")
        F, L, D = as_i64(file_offsets), as_i64(lengths), as_i64(dest_offsets)
        n = len(F)
        if len(L) != n or len(D) != n:
            raise _read_error(
                self.path,
                _errno.EINVAL,
                int(F[0]) if n else 0,
                int(L[0]) if len(L) else 0,
                f"mismatched index arrays (file_offsets has {n} entries, lengths {len(L)}, dest_offsets {len(D)})",
            )
        size = mv.nbytes
        bad = np.flatnonzero((F < 0) | (L < 0) | (D < 0) | (L > size) | (D > size - L))
        if bad.size:
            i = int(bad[0])
            f, l, d = int(F[i]), int(L[i]), int(D[i])
            if f < 0 or l < 0 or d < 0:
                what = f"negative value in request {i} (dest_offset={d})"
            else:
                what = f"destination too small for request {i} (dest_offset={d} + length > {size} bytes)"
            raise _read_error(self.path, _errno.EINVAL, f, l, what)
        keep = np.flatnonzero(L > 0)
        total = int(L[keep].sum()) if keep.size else 0
        # requests: (foff, len, doff, idx); long ones split into max_request pieces
        reqs = []
        maxreq = self._max_request
        for i in keep.tolist():
            f, l, d = int(F[i]), int(L[i]), int(D[i])
            if maxreq and l > maxreq:
                for k in range(0, l, maxreq):
                    reqs.append((f + k, min(maxreq, l - k), d + k, i, f, l))
            else:
                reqs.append((f, l, d, i, f, l))
        reqs.sort(key=lambda r: (r[0], r[3], r[2]))
        A = self.alignment
        base = address_of(mv) if A > 1 and size else 0
        maxgap = self._max_gap if coalesce else -1
        runs = []  # [foff, len, segs [(doff or None, len)], reqs, aligned]
        cur = None
        for r in reqs:
            f, l, d = r[:3]
            gap = f - (cur[0] + cur[1]) if cur else -1
            if (
                cur is not None
                and maxgap >= 0
                and 0 <= gap <= maxgap
                and len(cur[2]) + (2 if gap else 1) <= 1024
                and (not maxreq or cur[1] + gap + l <= maxreq)
            ):
                if gap:
                    cur[2].append((None, gap))
            else:
                cur = [f, 0, [], [], f % A == 0]
                runs.append(cur)
                gap = 0
            cur[2].append((d, l))
            cur[3].append(r)
            cur[1] += gap + l
            if (base + d) % A or l % A or gap % A:
                cur[4] = False
        return mv, runs, len(keep), total

    # ---- execution ----

    def _bounce(self, nbytes):
        buf = getattr(self._local, "bounce", None)
        if buf is None or len(buf) < nbytes:
            buf = self._local.bounce = _aligned_mmap(nbytes)
        return buf

    def _fail(self, run, err, got_in_run):
        foff, rlen, _, reqs, _ = run
        bad, end = reqs[0], foff + got_in_run  # for a short read: where the file ended
        if err == 0:
            for q in reqs:
                if q[0] + q[1] > end:
                    bad = q
                    break
        _, _, _, i, f, l = bad
        if err == 0:
            try:
                end = os.fstat(self._fd).st_size  # the true end of file
            except OSError:
                pass
        extra = ""
        if len(reqs) > 1 or foff != f or rlen != l:
            extra = f" (in a read of {len(reqs)} request piece(s) at offset {foff}, length {rlen})"
        if err == 0:
            what = f"short read (end of file at offset {end}) in request {i}{extra}"
            return _read_error(self.path, _errno.EIO, f, l, what)
        return _read_error(self.path, err, f, l, f"read failed: {os.strerror(err)} in request {i}{extra}")

    def _execute(self, mv, run, scratch, failed):
        if failed:
            return 0, 0
        foff, rlen, segs, _, aligned = run
        A = self.alignment
        bufs = [scratch[:l] if d is None else mv[d : d + l] for d, l in segs]
        gaps = [d is None for d, _ in segs]
        off, left, calls, nread = foff, rlen, 0, 0
        if aligned or A == 1:
            while left > 0:
                try:
                    n = os.preadv(self._fd, bufs, off)
                except InterruptedError:
                    continue
                except OSError as e:
                    raise self._fail(run, e.errno, off - foff) from e
                finally:
                    calls += 1
                if n == 0:
                    raise self._fail(run, 0, off - foff)
                nread += n
                off += n
                left -= n
                while n > 0 and bufs:  # partial read: drop what was filled
                    if n >= len(bufs[0]):
                        n -= len(bufs[0])
                        bufs.pop(0)
                        gaps.pop(0)
                    else:
                        bufs[0] = bufs[0][n:]
                        n = 0
                if left > 0 and A > 1:
                    break  # finish through the bounce buffer
            if left == 0:
                return calls, nread
        # unaligned: read the aligned superset into the bounce buffer, copy the wanted bytes
        bounce = self._bounce(self._bounce_bytes)
        bmv = memoryview(bounce)
        start, end = off - off % A, -(-(off + left) // A) * A
        pos, k, within = start, 0, 0
        try:
            while pos < end:
                chunk = min(end - pos, self._bounce_bytes)
                n = 0
                while n < chunk:
                    try:
                        m = os.preadv(self._fd, [bmv[n:chunk]], pos + n)
                    except InterruptedError:
                        continue
                    except OSError as e:
                        raise self._fail(run, e.errno, off - foff) from e
                    finally:
                        calls += 1
                    if m == 0:
                        break
                    nread += m
                    n += m
                    if A > 1 and m % A:
                        break
                lo, hi = max(pos, off), min(pos + n, off + left)
                src = lo - pos
                todo = max(0, hi - lo)
                while todo > 0 and k < len(bufs):
                    room = len(bufs[k]) - within
                    c = min(todo, room)
                    if not gaps[k]:
                        bufs[k][within : within + c] = bmv[src : src + c]
                    src += c
                    todo -= c
                    within += c
                    if within == len(bufs[k]):
                        k += 1
                        within = 0
                if n < chunk:
                    if pos + n < off + left:
                        raise self._fail(run, 0, off - foff + max(0, hi - off))
                    break
                pos += chunk
        finally:
            bmv.release()
        return calls, nread

    def _run_one(self, mv, run, scratch, state, left):
        try:
            calls, nread = self._execute(mv, run, scratch, state["error"] is not None)
        except ReadError as e:
            calls, nread = 0, 0
            with self._lock:
                if state["error"] is None:
                    state["error"] = e
        # Accounted inside the run, not in a done-callback: a callback may run after `wait` returns.
        with self._lock:
            self._stats["requests"] += calls
            self._stats["bytes_read"] += nread
            left[0] -= 1
            if left[0] == 0:
                self._inflight -= 1
                if self._inflight == 0:
                    self._stats["busy_ns"] += time.monotonic_ns() - self._busy_since

    def submit(self, dest, file_offsets, lengths, dest_offsets, *, coalesce: bool = True) -> _PyHandle:
        """Start a batch; returns a handle for `wait` (it keeps `dest` alive)."""
        mv, runs, nreads, total = self._plan(dest, file_offsets, lengths, dest_offsets, coalesce)
        biggest_gap = max((l for r in runs for d, l in r[2] if d is None), default=0)
        scratch = memoryview(_aligned_mmap(biggest_gap)) if biggest_gap else None
        state = {"error": None}
        with self._lock:
            if self._closed:
                f, l = runs[0][3][0][4:6] if runs else (0, 0)
                raise _read_error(self.path, _errno.EBADF, f, l, "read on a closed pool")
            self._stats["batches"] += 1
            self._stats["reads"] += nreads
            self._stats["bytes_requested"] += total
            if runs:
                if self._inflight == 0:
                    self._busy_since = time.monotonic_ns()
                self._inflight += 1
            left = [len(runs)]
            futures = [self._executor.submit(self._run_one, mv, r, scratch, state, left) for r in runs]
        return _PyHandle(futures, (dest, mv, scratch), total, state)

    def wait(self, handle: _PyHandle) -> int:
        """Block until the batch is done; returns its bytes requested. Raises ReadError."""
        return handle.wait()

    def read(self, dest, file_offsets, lengths, dest_offsets, *, coalesce: bool = True) -> int:
        """Read every request into `dest`; returns the bytes requested. Raises ReadError."""
        return self.wait(self.submit(dest, file_offsets, lengths, dest_offsets, coalesce=coalesce))

    def close(self) -> None:
        """Finish queued batches, join the threads, close the file. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._executor.shutdown(wait=True)
        os.close(self._fd)
        self._fd = -1

    def stats(self) -> dict:
        with self._lock:
            out = dict(self._stats)
            if self._inflight:  # the busy period in progress counts up to now
                out["busy_ns"] += time.monotonic_ns() - self._busy_since
            return out

    def reset_stats(self) -> None:
        with self._lock:
            for k in self._stats:
                self._stats[k] = 0
            self._busy_since = time.monotonic_ns()

    @property
    def fd(self) -> int:
        return self._fd

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self):
        return f"PythonReader({self.path!r}, threads={self.threads}, direct={self.direct})"


def open_reader(
    path,
    threads: int = DEFAULT_THREADS,
    direct: bool = True,
    native: Optional[bool] = None,
    alignment: Optional[int] = None,
    max_gap_bytes: int = DEFAULT_MAX_GAP_BYTES,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    bounce_bytes: int = DEFAULT_BOUNCE_BYTES,
):
    """Open `path` for batched reads. native=None: the C pool when built, else the Python
    fallback; True/False force one (True raises ImportError when the extension is missing).
    direct=True: uncached reads (O_DIRECT on Linux, F_NOCACHE on macOS); a filesystem that
    refuses O_DIRECT (tmpfs) raises ReadError. alignment=None: the O_DIRECT alignment the
    filesystem reports (`dio_alignment`, 512 on this project's disk), else 4096; requests,
    destinations and file offsets aligned to it are read straight into the destination,
    the others through a bounce buffer of `bounce_bytes` per thread. `reader.alignment` tells which was chosen."""
    kw = dict(
        threads=threads,
        direct=direct,
        alignment=alignment,
        max_gap_bytes=max_gap_bytes,
        max_request_bytes=max_request_bytes,
        bounce_bytes=bounce_bytes,
    )
    if native is None:
        native = have_native()
    reader = NativeReader(path, **kw) if native else PythonReader(path, **kw)
    return FaultyReader(reader) if FAIL_READ else reader


# Fault injection for tests of what follows a failed read, everywhere and without LD_PRELOAD:
# MLX_FLASH_FAIL_READ=n fails the n-th batch of reads this process submits (counted over every reader) with EIO.
FAIL_READ = int(os.environ.get("MLX_FLASH_FAIL_READ") or 0)
_batches = itertools.count(1)


class FaultyReader:
    """A reader whose FAIL_READ-th batch of the process is never read: its wait raises ReadError (EIO)."""

    _failed = object()

    def __init__(self, reader):
        self.reader = reader

    def __getattr__(self, name):
        return getattr(self.reader, name)

    def submit(self, *args, **kwargs):
        return self._failed if next(_batches) == FAIL_READ else self.reader.submit(*args, **kwargs)

    def wait(self, handle) -> int:
        if handle is self._failed:
            raise _read_error(self.reader.path, _errno.EIO, 0, 0, "read failed (injected by MLX_FLASH_FAIL_READ)")
        return self.reader.wait(handle)

    def read(self, *args, **kwargs) -> int:
        return self.wait(self.submit(*args, **kwargs))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.reader.close()
