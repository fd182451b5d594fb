"""The I/O engine (mlx_flash.io.reader + kernels/pread_pool.c): bytes land exactly where asked,
in numpy and MLX memory, for any offset/length/destination; coalescing and gap filling do
not change the bytes; every failure is a ReadError naming path, offset and length; the
Python fallback is byte-for-byte the native pool."""

import errno
import gc
import os
import threading

from mlx_flash.errors import FlashError, ReadError
from mlx_flash.io.reader import (
    NativeReader,
    PythonReader,
    address_of,
    aligned_buffer,
    aligned_rows,
    dio_alignment,
    have_native,
    max_gap_from_measurements,
    open_reader,
)

import mlx.core as mx
import numpy as np
import pytest

A = 4096
FILE_BYTES = 8 * 1024 * 1024 + 1234  # an unaligned tail on purpose

ENGINES = [pytest.param(True, id="native"), pytest.param(False, id="python")]
native_only = pytest.mark.skipif(not have_native(), reason="the C extension mlx_flash._pread_pool is not built")


def _odirect_refusal(directory) -> str:
    """'' when `directory` accepts aligned O_DIRECT reads, else why not (tmpfs refuses them)."""
    if not hasattr(os, "O_DIRECT"):
        return "no O_DIRECT on this platform (macOS uses F_NOCACHE, which has no alignment rule)"
    p = os.path.join(directory, ".odirect-probe")
    with open(p, "wb") as f:
        f.write(b"\1" * A)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
    except OSError as e:
        return f"the filesystem of {directory} refuses O_DIRECT: {e}"
    try:
        import mmap

        buf = mmap.mmap(-1, A)
        os.preadv(fd, [buf], 0)
        return ""
    except OSError as e:
        return f"O_DIRECT reads fail on {directory}: {e}"
    finally:
        os.close(fd)
        os.remove(p)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    """A file of random bytes on a real disk (tmp_path is ext4 here; tmpfs would refuse O_DIRECT)."""
    d = tmp_path_factory.mktemp("reader")
    path = d / "data.bin"
    data = np.random.default_rng(0).integers(0, 256, FILE_BYTES, dtype=np.uint8)
    data.tofile(path)
    return str(path), data


@pytest.fixture(scope="module")
def direct_ok(data_file):
    why = _odirect_refusal(os.path.dirname(data_file[0]))
    return why


@pytest.fixture(params=[pytest.param(True, id="direct"), pytest.param(False, id="cached")])
def direct(request, direct_ok):
    if request.param and direct_ok:
        pytest.skip(direct_ok)
    return request.param


@pytest.fixture(params=ENGINES)
def native(request):
    if request.param and not have_native():
        pytest.skip("the C extension mlx_flash._pread_pool is not built")
    return request.param


def _expect(data, fo, ln):
    return [data[f : f + l] for f, l in zip(fo, ln)]


def _check(out, data, fo, ln, do):
    out = np.frombuffer(memoryview(out).cast("B"), np.uint8)
    for i, (f, l, d) in enumerate(zip(fo, ln, do)):
        assert np.array_equal(out[d : d + l], data[f : f + l]), f"request {i}: offset={f} length={l} dest={d}"


# --------------------------------------------------------------------------------------
# Bytes land where asked


def test_aligned_reads_land_bit_exact_in_numpy(data_file, native, direct):
    path, data = data_file
    rng = np.random.default_rng(1)
    blocks = rng.permutation(FILE_BYTES // A)[:300]
    fo, ln = blocks * A, np.full(300, A)
    do = rng.permutation(300) * A
    base, off = aligned_buffer(300 * A)
    out = np.frombuffer(memoryview(base), np.uint8)
    with open_reader(path, threads=4, direct=direct, native=native) as r:
        assert r.read(base, fo, ln, off + do) == 300 * A
    _check(out, data, fo, ln, off + do)
    # every other byte of the destination is untouched (zero): nothing written out of place
    assert out[:off].sum() == 0 and out[off + 300 * A :].sum() == 0


def test_unaligned_offsets_lengths_and_tails(data_file, native, direct):
    """Odd offsets and lengths, unaligned destinations, the unaligned end of the file,
    zero-length reads and reads bigger than the bounce buffer."""
    path, data = data_file
    rng = np.random.default_rng(2)
    n = 200
    ln = rng.integers(0, 20000, n)
    fo = rng.integers(0, FILE_BYTES - 20000, n)
    ln[:3] = [0, 1, 3 * 1024 * 1024 + 17]  # zero, one byte, > 1 MiB bounce buffer
    fo[2] = 12345
    fo[3], ln[3] = FILE_BYTES - 1234, 1234  # the file's unaligned tail exactly
    fo[4], ln[4] = FILE_BYTES - 1, 1  # the last byte
    fo[5], ln[5] = 4095, 2  # straddles a block boundary
    do = np.concatenate([[0], np.cumsum(ln[:-1] + rng.integers(0, 7, n - 1))]) + 3  # odd destinations
    out = bytearray(int(do[-1] + ln[-1] + 5))
    with open_reader(path, threads=3, direct=direct, native=native) as r:
        r.read(out, fo, ln, do)
    _check(out, data, fo, ln, do)


def test_mx_array_destination_written_in_place(data_file, native, direct):
    """An evaluated mx.array is filled through its buffer: MLX computes on the new bytes
    with no copy, and the array's memory is the one written (same address before/after)."""
    path, data = data_file
    stride = 2 * A
    rows = aligned_rows(64, stride, dtype=mx.float16)
    assert address_of(rows.view) % A == 0
    assert address_of(rows.view) == address_of(rows.base) + rows.offset  # a view, not a copy
    addr_before = address_of(rows.base)
    src = np.random.default_rng(3).permutation(FILE_BYTES // stride)[:64]
    slots = np.arange(64)[::-1]
    with open_reader(path, threads=4, direct=direct, native=native) as r:
        r.read(rows.base, src * stride, np.full(64, stride), rows.dest_offsets(slots))
    expect = np.empty((64, stride), np.uint8)
    expect[slots] = data[: (FILE_BYTES // stride) * stride].reshape(-1, stride)[src]
    assert address_of(rows.base) == addr_before
    got = np.array(mx.view(rows.view, mx.uint8))
    assert np.array_equal(got, expect)
    # MLX computes on the bytes it now holds: the float16 values match numpy's reading of them
    as_f16 = expect.view(np.float16).astype(np.float64)
    finite = np.isfinite(as_f16)
    ours = mx.where(mx.array(finite), mx.abs(rows.view.astype(mx.float32)), 0).sum()
    assert np.isclose(ours.item(), np.abs(as_f16[finite]).sum(), rtol=1e-3)
    # an integer-valued check too: byte sum through an MLX reduction
    assert mx.sum(mx.view(rows.view, mx.uint8).astype(mx.uint32)).item() == int(expect.sum(dtype=np.uint64))


@pytest.mark.parametrize("dtype", [mx.uint8, mx.bfloat16], ids=["uint8", "bfloat16"])
def test_plain_mlx_array_unaligned_is_still_correct(data_file, native, direct, dtype):
    """A default MLX allocation (24 bytes past a page boundary on Linux) with direct=True goes
    through the bounce buffer; the bytes are still exact and visible to MLX."""
    path, data = data_file
    a = mx.zeros((10 * A // dtype.size,), dtype=dtype)
    mx.eval(a)
    with open_reader(path, threads=2, direct=direct, native=native) as r:
        r.read(a, [A, 5 * A], [4 * A, 6 * A], [0, 4 * A])
    as_bytes = mx.view(a, mx.uint8)
    assert np.array_equal(np.array(as_bytes), data[A : 11 * A])
    assert mx.sum(as_bytes.astype(mx.uint32)).item() == int(data[A : 11 * A].sum(dtype=np.uint64))


def test_aligned_rows_layout():
    rows = aligned_rows(5, 3 * A)
    assert rows.view.shape == (5, 3 * A)
    for r in range(5):  # every row starts aligned and is a basic slice of base
        assert (address_of(rows.base) + int(rows.dest_offsets([r])[0])) % A == 0
        assert address_of(rows.view[r : r + 1]) == address_of(rows.base) + int(rows.dest_offsets([r])[0])
    base, off = aligned_buffer(1000, alignment=512)
    assert (address_of(base) + off) % 512 == 0 and base.nbytes - off >= 1000


def test_alignment_is_asked_from_the_filesystem(data_file, native, direct):
    path, _ = data_file
    with open_reader(path, threads=1, direct=direct, native=native) as r:
        want = (dio_alignment(path) or 4096) if direct and hasattr(os, "O_DIRECT") else 1
        assert r.alignment == want
    with open_reader(path, threads=1, direct=direct, native=native, alignment=4096) as r:
        assert r.alignment == (4096 if direct and hasattr(os, "O_DIRECT") else 1)


def test_small_aligned_bundles_go_straight_to_the_destination(data_file, native, direct):
    """Bundles of 1536 B on 512 B boundaries (the format's alignment for small models) are read
    without a bounce buffer when the filesystem allows 512 B O_DIRECT, and are exact either way."""
    path, data = data_file
    stride = 1536
    src = np.random.default_rng(7).permutation(FILE_BYTES // stride)[:100]
    for alignment in (None, 4096):
        rows = aligned_rows(100, stride, alignment=512)
        with open_reader(path, threads=2, direct=direct, native=native, alignment=alignment) as r:
            r.read(rows.base, src * stride, np.full(100, stride), rows.dest_offsets(np.arange(100)), coalesce=False)
            st, a = r.stats(), r.alignment
        assert np.array_equal(np.array(rows.view), data[: (FILE_BYTES // stride) * stride].reshape(-1, stride)[src])
        if a <= 512:  # straight in: one syscall per bundle, no extra bytes
            assert st["requests"] == 100 and st["bytes_read"] == 100 * stride
        else:  # bounced: the aligned superset is read
            assert st["bytes_read"] > 100 * stride


def test_a_small_bounce_buffer_reads_long_unaligned_runs(data_file, native, direct):
    """bounce_bytes (the FFN reader's is small: its memory is in the budget) only sets the chunk an unaligned run is
    read in: a run 40x its size, at an odd offset into an odd destination, is exact."""
    path, data = data_file
    fo, ln, do = np.array([777]), np.array([40 * 4096 + 5]), np.array([3])
    out = bytearray(int(ln[0]) + 8)
    with open_reader(path, threads=2, direct=direct, native=native, bounce_bytes=4096) as r:
        r.read(out, fo, ln, do)
    _check(out, data, fo, ln, do)
    with pytest.raises(ValueError, match="bounce"):
        open_reader(path, native=native, bounce_bytes=100)


def test_packed_units_at_every_offset(data_file, native, direct):
    """Packed units (format v3: 1376 B apart, SmolLM2's unit size, so they straddle 512 B blocks at every phase)
    read into packed cache rows: scattered units, runs starting mid-block, single units; bytes exact, and the
    device reads the aligned superset of each run's blocks and no more."""
    path, data = data_file
    stride, n = 1376, 64
    units = data[: n * stride].reshape(n, stride)
    rng = np.random.default_rng(8)
    cases = [
        np.arange(n),
        np.array([3]),
        np.arange(5, 12),
        np.sort(rng.choice(n, 20, replace=False)),
        np.array([n - 1, 0]),
    ]
    for chosen in cases:
        base, off = aligned_buffer(len(chosen) * stride, 16)
        slots = rng.permutation(len(chosen))
        with open_reader(path, threads=2, direct=direct, native=native) as r:
            r.read(base, chosen * stride, np.full(len(chosen), stride), off + slots * stride)
            st, a = r.stats(), r.alignment
        got = np.frombuffer(memoryview(base), np.uint8)[off : off + len(chosen) * stride].reshape(-1, stride)
        assert np.array_equal(got[slots], units[chosen]), chosen
        blocks = set()  # the aligned blocks the chosen units span
        for u in chosen:
            blocks.update(range(u * stride // a, -(-(u + 1) * stride // a)))
        assert (
            len(chosen) * stride
            <= st["bytes_read"]
            <= max(len(blocks) * a, len(chosen) * stride)
            + (r.max_gap_bytes if hasattr(r, "max_gap_bytes") else 0) * len(chosen)
        )


def test_overlapping_and_duplicate_requests(data_file, native, direct):
    path, data = data_file
    fo = np.array([0, 0, A, 2 * A - 100, 10 * A, 10 * A + A])
    ln = np.array([2 * A, A, A, 300, 2 * A, A])
    do = np.cumsum(np.concatenate([[0], ln[:-1]]))
    out = np.zeros(int(ln.sum()), np.uint8)
    with open_reader(path, threads=2, direct=direct, native=native, max_gap_bytes=A) as r:
        r.read(out, fo, ln, do)
    _check(out, data, fo, ln, do)


# --------------------------------------------------------------------------------------
# Coalescing


def test_coalesced_uncoalesced_and_gap_filled_give_the_same_bytes(data_file, native, direct):
    path, data = data_file
    # 40 groups: 6 adjacent bundles, then bundles with 1-block holes, in shuffled order
    rng = np.random.default_rng(4)
    starts = rng.permutation(FILE_BYTES // (32 * A) - 1)[:40] * 32 * A
    fo = np.concatenate([s + np.r_[0:6, 7, 9, 11] * A for s in starts])
    perm = rng.permutation(fo.size)
    fo = fo[perm]
    ln = np.full(fo.size, A)
    do = np.arange(fo.size) * A
    outs, stats = {}, {}
    for name, coalesce, gap in [("separate", False, 0), ("adjacent", True, 0), ("gap-filled", True, A)]:
        base, off = aligned_buffer(fo.size * A)
        with open_reader(path, threads=4, direct=direct, native=native, max_gap_bytes=gap) as r:
            r.read(base, fo, ln, off + do, coalesce=coalesce)
            stats[name] = r.stats()
        outs[name] = np.array(base)[off : off + fo.size * A]
    _check(outs["separate"], data, fo, ln, do)
    assert np.array_equal(outs["separate"], outs["adjacent"])
    assert np.array_equal(outs["separate"], outs["gap-filled"])
    n = fo.size
    assert stats["separate"]["requests"] == n
    assert stats["adjacent"]["requests"] == 40 * 4  # one run of 6, then 3 isolated bundles
    assert stats["gap-filled"]["requests"] == 40  # holes of one block are read and dropped
    assert stats["gap-filled"]["bytes_read"] == 40 * 12 * A
    for s in stats.values():
        assert s["reads"] == n and s["bytes_requested"] == n * A and s["batches"] == 1


def test_long_requests_are_split_and_runs_capped(data_file, native, direct):
    path, data = data_file
    with open_reader(path, threads=4, direct=direct, native=native, max_request_bytes=256 * 1024) as r:
        base, off = aligned_buffer(3 * 1024 * 1024)
        r.read(base, [A], [3 * 1024 * 1024 - A], [off])
        assert r.stats()["requests"] == 12  # 3 MiB - 4 KiB in 256 KiB pieces
        assert np.array_equal(np.array(base)[off : off + 3 * 1024 * 1024 - A], data[A : 3 * 1024 * 1024])
        r.reset_stats()
        r.read(base, np.arange(128) * A, np.full(128, A), off + np.arange(128) * A)  # 512 KiB contiguous
        assert r.stats()["requests"] == 2
        assert np.array_equal(np.array(base)[off : off + 128 * A], data[: 128 * A])


def test_error_names_the_callers_request_not_a_piece(data_file, native, direct):
    path, _ = data_file
    base, off = aligned_buffer(4 * 1024 * 1024)
    with open_reader(path, threads=2, direct=direct, native=native, max_request_bytes=1 << 20) as r:
        with pytest.raises(ReadError) as ei:  # split in 1 MiB pieces, the last ones past the end
            r.read(base, [FILE_BYTES - 2 * 1024 * 1024], [4 * 1024 * 1024], [off])
    _assert_read_error(ei, path, FILE_BYTES - 2 * 1024 * 1024, 4 * 1024 * 1024)
    assert f"end of file at offset {FILE_BYTES}" in str(ei.value)


def test_iov_max_respected(data_file, native):
    """More adjacent requests than IOV_MAX (1024) in one contiguous range still read right."""
    path, data = data_file
    n = 3000
    fo = np.arange(n) * 100
    ln = np.full(n, 100)
    out = bytearray(n * 100)
    with open_reader(path, threads=2, direct=False, native=native, max_request_bytes=0) as r:
        r.read(out, fo, ln, fo)
        assert r.stats()["requests"] == 3  # 1024 + 1024 + 952 iovecs
    assert bytes(out) == data[: n * 100].tobytes()


def test_max_gap_from_measurements():
    sizes = np.array([4, 16, 32, 64, 128, 1024]) * 1024
    t0, bw = 50e-6, 1e9  # cost = 50 us + s / (1 GB/s): merging pays while gap < t0 * bw = 50 kB
    cost = t0 + sizes / bw
    assert max_gap_from_measurements(sizes, cost) == 49152
    assert max_gap_from_measurements(sizes, cost, alignment=1) == pytest.approx(50000, abs=2)
    # the same rule solved on the curve for a given request size
    assert max_gap_from_measurements(sizes, cost, request_bytes=16384, alignment=1) == pytest.approx(50000, abs=2)
    # pure bandwidth (no per-request cost): never fill
    assert max_gap_from_measurements(sizes, sizes / bw) == 0


# --------------------------------------------------------------------------------------
# Errors


def _assert_read_error(exc_info, path, offset, length):
    e = exc_info.value
    assert isinstance(e, ReadError) and isinstance(e, OSError) and isinstance(e, FlashError)
    msg = str(e)
    assert str(path) in msg and f"offset={offset}" in msg and f"length={length}" in msg, msg
    assert e.offset == offset and e.length == length


def test_short_read_past_end_of_file(data_file, native, direct):
    path, _ = data_file
    out = bytearray(3 * A)
    with open_reader(path, threads=2, direct=direct, native=native) as r:
        with pytest.raises(ReadError) as ei:  # starts inside the file, ends past it
            r.read(out, [A, FILE_BYTES - 1000], [A, 3000], [0, A])
        _assert_read_error(ei, path, FILE_BYTES - 1000, 3000)
        assert ei.value.errno == errno.EIO and f"short read (end of file at offset {FILE_BYTES})" in str(ei.value)
        with pytest.raises(ReadError) as ei:  # entirely past the end, inside a coalesced run
            r.read(out, [FILE_BYTES - 34, FILE_BYTES, FILE_BYTES + 100], [34, 100, 100], [0, 100, 200])
        _assert_read_error(ei, path, FILE_BYTES, 100)
        # the pool is still usable after an error
        assert r.read(out, [0], [A], [0]) == A


def test_eio(native):
    """/proc/self/mem at offset 0 (an unmapped page) fails with EIO."""
    if not os.path.exists("/proc/self/mem"):
        pytest.skip("no /proc/self/mem on this platform")
    with open_reader("/proc/self/mem", threads=1, direct=False, native=native) as r:
        with pytest.raises(ReadError) as ei:
            r.read(bytearray(A), [0], [A], [0])
    _assert_read_error(ei, "/proc/self/mem", 0, A)
    assert ei.value.errno == errno.EIO


def test_ebadf(data_file, native):
    path, _ = data_file
    r = open_reader(path, threads=2, direct=False, native=native)
    fd = r._pool.fd if native else r.fd
    saved = os.dup(fd)
    os.close(fd)  # pull the descriptor from under the pool
    try:
        with pytest.raises(ReadError) as ei:
            r.read(bytearray(A), [123], [456], [0])
        _assert_read_error(ei, path, 123, 456)
        assert ei.value.errno == errno.EBADF
    finally:
        os.dup2(saved, fd)  # give the pool a descriptor to close
        os.close(saved)
        r.close()


def test_argument_errors(data_file, native):
    path, _ = data_file
    with open_reader(path, threads=2, direct=False, native=native) as r:
        out = bytearray(1000)
        with pytest.raises(ReadError) as ei:  # destination too small
            r.read(out, [0, 5000], [10, 100], [0, 950])
        _assert_read_error(ei, path, 5000, 100)
        assert "destination too small" in str(ei.value)
        with pytest.raises(ReadError) as ei:  # negative offset
            r.read(out, [-4096], [10], [0])
        _assert_read_error(ei, path, -4096, 10)
        with pytest.raises(ReadError) as ei:  # negative length
            r.read(out, [7], [-1], [0])
        _assert_read_error(ei, path, 7, -1)
        with pytest.raises(ReadError) as ei:  # negative destination offset
            r.read(out, [7], [8], [-9])
        _assert_read_error(ei, path, 7, 8)
        with pytest.raises(ReadError) as ei:  # mismatched arrays
            r.read(out, [1, 2], [3], [0, 0])
        _assert_read_error(ei, path, 1, 3)
        assert "mismatched" in str(ei.value)
        with pytest.raises((TypeError, BufferError)):  # read-only destination
            r.read(b"x" * 1000, [0], [10], [0])
        assert bytes(out) == bytes(1000)  # nothing was read by the rejected batches


def test_open_errors(tmp_path, native):
    with pytest.raises(ReadError) as ei:
        open_reader(tmp_path / "missing.bin", native=native)
    assert ei.value.errno == errno.ENOENT and "missing.bin" in str(ei.value)


def test_close_joins_threads_and_later_use_raises(data_file, native):
    path, data = data_file

    def tasks():  # the process's threads, by id: another test's thread ending meanwhile changes no count here
        if os.path.isdir("/proc/self/task"):
            return set(os.listdir("/proc/self/task"))
        return {t.ident for t in threading.enumerate()}

    before = tasks()
    r = open_reader(path, threads=6, direct=False, native=native)
    out = bytearray(A)
    r.read(out, [0], [A], [0])  # the Python fallback starts its threads lazily
    started = tasks() - before
    assert started
    r.close()
    gc.collect()
    assert not started & tasks(), "close() left threads behind"
    assert r.closed
    with pytest.raises(ReadError) as ei:
        r.read(out, [0], [A], [0])
    assert "closed" in str(ei.value) and path in str(ei.value)
    with pytest.raises(ReadError):
        r.submit(out, [0], [A], [0])
    r.close()  # idempotent
    with open_reader(path, threads=2, direct=False, native=native) as r2:
        r2.read(out, [A], [A], [0])
    assert r2.closed and bytes(out) == data[A : 2 * A].tobytes()


# --------------------------------------------------------------------------------------
# Async and concurrency


def test_submit_wait_overlaps_compute(data_file, native, direct):
    path, data = data_file
    rows = aligned_rows(256, A)
    src = np.random.default_rng(5).permutation(FILE_BYTES // A)[:256]
    with open_reader(path, threads=4, direct=direct, native=native) as r:
        h = r.submit(rows.base, src * A, np.full(256, A), rows.dest_offsets(np.arange(256)))
        x = mx.random.normal((256, 256))
        mx.eval(x @ x)  # compute while the reads run
        assert r.wait(h) == 256 * A
        assert h.done
        assert r.wait(h) == 256 * A  # waiting again returns the same result
        assert np.array_equal(np.array(rows.view), data[: (FILE_BYTES // A) * A].reshape(-1, A)[src])
        # the handle keeps a temporary destination alive
        h = r.submit(bytearray(2 * A), [0, A], [A, A], [0, A])
        gc.collect()
        assert r.wait(h) == 2 * A
        # errors of an async batch surface at wait()
        h = r.submit(bytearray(A), [FILE_BYTES], [A], [0])
        with pytest.raises(ReadError) as ei:
            r.wait(h)
        _assert_read_error(ei, path, FILE_BYTES, A)


def test_concurrent_batches_from_four_threads(data_file, native, direct):
    path, data = data_file
    errors = []

    with open_reader(path, threads=4, direct=direct, native=native) as r:

        def worker(seed):
            try:
                rng = np.random.default_rng(seed)
                for _ in range(15):
                    n = 64
                    fo = rng.integers(0, FILE_BYTES - 9000, n)
                    fo[: n // 2] -= fo[: n // 2] % A  # half aligned, half not
                    ln = rng.integers(1, 9000, n)
                    do = np.arange(n) * 9000
                    out = np.zeros(n * 9000, np.uint8)
                    if seed % 2:
                        r.read(out, fo, ln, do)
                    else:
                        r.wait(r.submit(out, fo, ln, do))
                    _check(out, data, fo, ln, do)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        ts = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in ts), "a batch hung"
        assert r.stats()["batches"] == 60
    assert not errors, errors


def test_read_releases_the_gil(data_file, native, direct_ok):
    """While read() runs in one Python thread, another keeps running Python code: the longest
    pause the spinning main thread sees during the read is far shorter than the read."""
    import time

    if direct_ok:
        pytest.skip(direct_ok)
    if not native:  # a spinning thread starves the fallback's workers of the GIL between reads
        pytest.skip("the fallback releases the GIL inside os.preadv; this checks the C pool")
    path, _ = data_file
    offsets = np.random.default_rng(8).integers(0, FILE_BYTES // A, 3000) * A  # ~0.1-0.3 s uncached
    lengths, dests = np.full(offsets.size, A), np.zeros(offsets.size, np.int64)
    out = np.zeros(A, np.uint8)
    window = []
    with open_reader(path, threads=1, direct=True, native=native) as r:

        def reader():
            t0 = time.perf_counter()
            r.read(out, offsets, lengths, dests, coalesce=False)
            window.extend([t0, time.perf_counter()])

        t = threading.Thread(target=reader)
        pauses = []  # (start, end) of every pause > 1 ms between two iterations
        t.start()
        prev = time.perf_counter()
        while t.is_alive():
            now = time.perf_counter()
            if now - prev > 1e-3:
                pauses.append((prev, now))
            prev = now
        t.join()
    t0, t1 = window
    if t1 - t0 < 0.05:
        pytest.skip(f"the read took only {t1 - t0:.3f} s: too short to tell")
    longest = max([min(b, t1) - max(a, t0) for a, b in pauses if b > t0 and a < t1] or [0.0])
    assert longest < 0.5 * (t1 - t0), f"main thread paused {longest:.3f} s during a {t1 - t0:.3f} s read"


def test_close_while_batches_are_queued_finishes_them(data_file, native):
    path, data = data_file
    r = open_reader(path, threads=2, direct=False, native=native)
    outs, hs = [], []
    for k in range(10):
        out = np.zeros(64 * A, np.uint8)
        outs.append(out)
        hs.append(r.submit(out, np.arange(64) * A + k * A, np.full(64, A), np.arange(64) * A, coalesce=False))
    r.close()
    for k, (h, out) in enumerate(zip(hs, outs)):
        assert r.wait(h) == 64 * A
        assert np.array_equal(out, data[k * A : (k + 64) * A])


# --------------------------------------------------------------------------------------
# Fallback


@native_only
def test_fallback_equals_native_byte_for_byte(data_file, direct):
    path, _ = data_file
    rng = np.random.default_rng(6)
    n = 500
    fo = rng.integers(0, FILE_BYTES - 10000, n)
    fo[::3] -= fo[::3] % A
    ln = rng.integers(0, 10000, n)
    ln[::3] = A
    do = rng.permutation(n) * 10000
    outs = []
    for native in (True, False):
        with open_reader(path, threads=4, direct=direct, native=native, max_gap_bytes=2 * A) as r:
            assert isinstance(r, NativeReader if native else PythonReader)
            out = np.full(n * 10000, 7, np.uint8)
            r.read(out, fo, ln, do)
            outs.append(out)
            stats = r.stats()
            del stats["busy_ns"]  # a time
            outs.append(stats)
    assert np.array_equal(outs[0], outs[2])
    assert outs[1] == outs[3]  # same plan: same syscalls, same bytes read


def test_open_reader_picks_native_when_built(data_file):
    path, _ = data_file
    with open_reader(path, direct=False) as r:
        assert r.native == have_native()
    with open_reader(path, direct=False, native=False) as r:
        assert isinstance(r, PythonReader) and r.threads >= 1


def test_bench_io_runs(tmp_path, capsys, monkeypatch):
    """The benchmark command end to end on a tiny file (no fio): it prints the table and JSON."""
    if _odirect_refusal(str(tmp_path)):
        pytest.skip(_odirect_refusal(str(tmp_path)))
    import json
    import sys

    from mlx_flash.tools import bench_io

    out = tmp_path / "r.json"
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "bench_io",
            "--dir",
            str(tmp_path),
            "--size-gib",
            "0.02",
            "--block-sizes",
            "4k,64k",
            "--threads",
            "1,2",
            "--seconds",
            "0.05",
            "--repeats",
            "1",
            "--no-fio",
            "--bundle-sizes",
            "4k",
            "--adjacent",
            "4",
            "--json",
            str(out),
        ],
    )
    bench_io.main()
    res = json.loads(out.read_text())
    assert len(res["points"]) == 4 and res["recommended_threads"] in (1, 2)
    assert "| block |" in capsys.readouterr().out
    assert not (tmp_path / "bench_io.bin").exists()  # deleted without --keep


@pytest.mark.parametrize("native", [True, False])
def test_busy_time_counts_time_with_reads_in_flight(tmp_path, native):
    """busy_ns grows while a batch is in flight and not while the pool is idle (bytes_read / busy_ns is the
    pool's throughput, compared with fio's); reset_stats zeroes it."""
    import time as _time

    from mlx_flash.io.reader import aligned_buffer, have_native, open_reader

    if native and not have_native():
        pytest.skip("native pool not built")
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(8 << 20))
    r = open_reader(str(path), threads=4, direct=False, native=native)
    try:
        buf, base = aligned_buffer(8 << 20, 4096)
        offs = np.arange(0, 8 << 20, 1 << 20, dtype=np.int64)
        r.read(buf, offs, np.full(len(offs), 1 << 20), base + offs)
        busy = r.stats()["busy_ns"]
        assert busy > 0
        _time.sleep(0.05)
        assert r.stats()["busy_ns"] == busy  # idle time is not busy
        r.reset_stats()
        assert r.stats()["busy_ns"] == 0
    finally:
        r.close()


def test_source_reader_reads_several_files_in_one_batch(data_file, tmp_path, native, direct):
    """SourceReader (units in place): one batch naming bytes of two files lands as each file holds them, each file's
    stats summed; a request past one file's end raises ReadError naming it after the other file's reads finished."""
    from mlx_flash.io.sources import FILE_SHIFT, SourceReader

    path, data = data_file
    other = np.random.default_rng(1).integers(0, 256, 3 * A + 77, dtype=np.uint8)
    second = os.path.join(os.path.dirname(path), "other.bin")
    other.tofile(second)
    reqs = [(1, 5, 1000), (0, A + 3, 2 * A), (1, 2 * A, A + 77), (0, 17, 100)]  # (file, offset, length)
    dest = np.zeros(sum(n for _, _, n in reqs), dtype=np.uint8)
    at = np.cumsum([0] + [n for _, _, n in reqs])[:-1]
    with SourceReader([path, second], threads=2, direct=direct, native=native) as r:
        offsets = [(f << FILE_SHIFT) + o for f, o, _ in reqs]
        assert r.read(dest, offsets, [n for _, _, n in reqs], at) == dest.nbytes
        for (f, o, n), a in zip(reqs, at):
            assert np.array_equal(dest[a : a + n], (data, other)[f][o : o + n])
        assert r.stats()["bytes_requested"] == dest.nbytes
        with pytest.raises(ReadError, match="other.bin"):
            r.read(dest, [5, (1 << FILE_SHIFT) + other.nbytes], [10, 10], [0, 10])
        assert r.read(dest, [(1 << FILE_SHIFT)], [10], [0]) == 10  # still usable
        with pytest.raises(ReadError, match="no source file 2"):
            r.read(dest, [2 << FILE_SHIFT], [10], [0])
