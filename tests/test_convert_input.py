"""Bad input to `python -m mlx_flash.convert` never crashes: a damaged GGUF, a signal mid-way and a mistyped path
each end in one line naming what is wrong (no traceback, no core dump), and leave no temporary directory behind."""

import gc
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
from contextlib import contextmanager

from mlx_flash.convert.gguf import MX_LOAD_EXACT, read_header
from mlx_flash.convert.source import resolve_source
from mlx_flash.errors import DiskSpaceError, SourceError

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


def convert_cli(*args, cwd=None):
    env = dict(os.environ, HF_HUB_OFFLINE="1")  # nothing is ever fetched
    return subprocess.run(
        [sys.executable, "-m", "mlx_flash.convert", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env=env,
    )


def assert_refused(r, *words):
    """Ended by mlx_flash (a nonzero exit status, not a signal) with one line on stderr naming what is wrong."""
    assert r.returncode > 0, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    for w in words:
        assert w in r.stderr, r.stderr


def leftovers(folder, out="out"):
    return sorted(p.name for p in folder.iterdir() if p.name == out or p.name.startswith(f".{out}."))


# -- a damaged GGUF ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("counts", [None, (3, 2, 5)], ids=["random", "plausible-counts"])
def test_a_damaged_gguf_header_is_refused(tmp_path, counts):
    """The GGUF magic, then 5 MB of random bytes (or a valid version and small counts, then random bytes): mx.load
    dies of SIGSEGV on such a file, so the header is checked before it runs."""
    head = b"GGUF"
    if counts is not None:
        version, n_tensors, n_kv = counts
        head += version.to_bytes(4, "little") + n_tensors.to_bytes(8, "little") + n_kv.to_bytes(8, "little")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(head + np.random.default_rng(0).bytes(5_000_000))
    assert_refused(convert_cli("--model", bad, "--out", tmp_path / "out"), "bad.gguf")
    assert leftovers(tmp_path) == []


def small_gguf(path):
    """A small valid GGUF: metadata of every kind the header check reads (scalars, strings, arrays of numbers, bools
    and strings, general.alignment) and tensors of the types mx.load reads itself, converts or cannot read."""
    T = gguf.GGMLQuantizationType
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("general.alignment", 32)
    w.add_block_count(1)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_token_list(["<s>", "a", "b\u00e9"])
    w.add_token_types([3, 1, 1])
    w.add_array("test.bools", [True, False])
    w.add_int64("test.big", -(2**40))
    w.add_tensor("f32.weight", np.ones(4, np.float32))
    w.add_tensor("f16.weight", np.ones((2, 32), np.float16))
    for name, qtype, shape in (("q4.weight", T.Q4_0, (2, 32)), ("q8.weight", T.Q8_0, (1, 64))):
        w.add_tensor(name, gguf.quants.quantize(np.ones(shape, np.float32), qtype), raw_dtype=qtype)
    w.add_tensor("k.weight", np.full((1, 144), 17, np.uint8), raw_dtype=T.Q4_K)  # (any bytes are a Q4_K block)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def header_fields(path):
    """(offset, width) of every number the header check reads: counts, lengths, value and tensor types, dimensions,
    offsets, and the values themselves."""
    from mlx_flash.convert import gguf as g

    fields = []

    class Recorder(g.GGUFFile):
        def _unpack(self, fmt):
            fields.append((self._pos, struct.calcsize(fmt)))
            return super()._unpack(fmt)

    h = Recorder(path)
    return fields, h.tensors[0].data_offset


def number_at(path, field):
    """(offset, width) of a number in the header: `field` is its index (0 the version, 1 the tensor count, 2 the
    metadata count), or (a key or tensor name, the index of a number after it: a key's value type, then its value or
    element type and count; a tensor's dimension count, dimensions, type, offset)."""
    fields, _ = header_fields(path)
    if isinstance(field, int):
        return fields[field]
    name = field[0].encode()
    data = path.read_bytes()
    end = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    return fields[[pos for pos, _ in fields].index(end) + field[1]]


def test_the_small_gguf_reads_as_gguf_reads_it(tmp_path):
    """The fuzzing's starting point passes the check, read as the gguf package reads it."""
    p = small_gguf(tmp_path / "small.gguf")
    h, ref = read_header(p), gguf.GGUFReader(str(p))
    assert h.fields == {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert [(t.name, t.tensor_type, t.data_offset, t.n_bytes) for t in h.tensors] == [
        (t.name, t.tensor_type, t.data_offset, t.n_bytes) for t in ref.tensors
    ]


def patched(src, dst, at, value, width):
    data = bytearray(src.read_bytes())
    data[at : at + width] = value.to_bytes(width, "little")
    dst.write_bytes(bytes(data))
    return dst


@pytest.mark.parametrize(
    "field, value, says",
    [
        (0, 1, "version 1 is not supported"),
        (1, 2**40, "tensors and"),  # the tensor count
        (2, 2**33, "metadata items cannot fit"),  # the metadata count
        (("general.alignment", 0), 0, "general.alignment has value type"),  # its type: uint8, not uint32
        (("tokenizer.ggml.tokens", 1), 9, "array element type 9"),  # an array of arrays
        (("tokenizer.ggml.tokens", 2), 2**62, "strings at byte"),  # the string array's length
        (("f16.weight", 0), 5, "5 dimensions"),
        (("f16.weight", 1), 2**64 - 1, "past the end"),  # its first dimension
        (("q4.weight", 3), 77, "unknown type 77"),
        (("q4.weight", 3), 16, "not rows of whole IQ2_XXS blocks"),  # a 256-value block type on 32-value rows
        (("q8.weight", 4), 3, "not a multiple of the alignment"),  # its offset
    ],
)
def test_what_the_header_check_refuses(tmp_path, field, value, says):
    """A number of the header changed (number_at): the check names what is wrong in one line."""
    src = small_gguf(tmp_path / "small.gguf")
    at, width = number_at(src, field)
    bad = patched(src, tmp_path / "bad.gguf", at, value % 256**width, width)
    with pytest.raises(SourceError, match="bad.gguf: not a valid GGUF file: .*" + says) as e:
        read_header(bad)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("counts", [(1, 1), (3, 40), (0, 380_000), (150_000, 0)])
def test_random_bytes_after_a_valid_version_are_refused(tmp_path, counts):
    """5 MB of random bytes after a valid version and tensor / metadata counts that fit in the file."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, *counts) + np.random.default_rng(0).bytes(5_000_000))
    with pytest.raises(SourceError, match="bad.gguf"):
        read_header(bad)


def test_the_check_takes_time_bounded_by_the_file_size(tmp_path):
    """The most items 5 MB can hold (an array of 625,000 empty strings) is read in about half a second."""
    n = 5_000_000 // 8
    p = tmp_path / "strings.gguf"
    p.write_bytes(b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 1) + b"a" + struct.pack("<IIQ", 9, 8, n) + bytes(8 * n))
    start = time.perf_counter()
    assert read_header(p).fields == {"a": [""] * n}
    assert time.perf_counter() - start < 5


@pytest.mark.parametrize(
    "field, value, says",
    [
        (("llama.attention.head_count", 1), 0, "head_count 0"),
        (("llama.attention.head_count_kv", 1), 0, "head_count_kv 0"),
        (("llama.block_count", 0), 6, "block_count is '5.6.*e-45', not an integer"),  # uint32 4 read as a float32
    ],
)
def test_metadata_values_that_cannot_be_a_model(tmp_path, field, value, says):
    """A header that is sound but whose values cannot describe a model (zero heads, a count that is no integer):
    SourceError, where they divided by zero or became a model of no layers."""
    from mlx_flash.convert.gguf import gguf_to_mlx_dir
    from mlx_flash.tools.synthetic_gguf import write_gguf

    src = write_gguf("tiny", tmp_path / "tiny.gguf", progress=False, vocab_size=320)
    at, width = number_at(src, field)
    bad = patched(src, tmp_path / "bad.gguf", at, value, width)
    with pytest.raises(SourceError, match=says):
        gguf_to_mlx_dir(bad, tmp_path / "out")


def test_metadata_of_the_wrong_kind():
    from mlx_flash.convert.gguf_archs import Meta

    meta = Meta({"n": "12", "x": [1.5], "f": "1e-5", "ok": 4.0}, "m.gguf")
    assert meta.int("ok") == 4 and meta.float("ok") == 4.0
    for get, key in ((meta.int, "n"), (meta.int, "x"), (meta.float, "f"), (meta.float, "x")):
        with pytest.raises(SourceError, match=f"m.gguf: GGUF metadata {key} is .*, not an? (integer|number)"):
            get(key)


# The mutated files that passed the check, each loaded by mx.load in a child process: a SIGSEGV there (what the
# check exists to prevent) fails the test, naming the file; Python exceptions (a type mx.load cannot read) are fine.
MX_LOAD_EACH = """
import sys
import mlx.core as mx
for path in sys.argv[1:]:
    print(path, flush=True)
    try:
        mx.load(path, format="gguf", return_metadata=True)
    except Exception:
        pass
"""

INTERESTING = [0, 1, 2, 3, 4, 7, 8, 9, 12, 13, 31, 32, 33, 64, 255, 256, 2**31 - 1, 2**31, 2**32 - 1, 2**32]
INTERESTING += [2**63 - 1, 2**63, 2**64 - 1]


def test_fuzzed_headers_are_refused_or_read_correctly(tmp_path):
    """Mutated headers of a small valid GGUF (numbers of the header set to edge values, random bytes overwritten,
    the file cut short): every outcome is SourceError or a header whose every tensor lies within the file and reads
    as gguf's own reader reads it, each within the deadline; and mx.load survives every header that passes of the
    files the converter gives it (gguf.MX_LOAD_EXACT's types)."""
    src = small_gguf(tmp_path / "small.gguf")
    data = src.read_bytes()
    fields, header_end = header_fields(src)
    passed = []

    @settings(
        max_examples=1000,
        deadline=1000,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(
        edits=st.lists(
            st.one_of(
                st.tuples(st.sampled_from(fields), st.sampled_from(INTERESTING) | st.integers(0, 2**64 - 1)),
                st.tuples(st.tuples(st.integers(0, header_end - 1), st.just(1)), st.integers(0, 255)),
            ),
            min_size=1,
            max_size=3,
        ),
        cut=st.none() | st.integers(0, len(data)),
    )
    def check(edits, cut):
        mutated = bytearray(data)
        for (at, width), value in edits:
            mutated[at : at + width] = (value % 256**width).to_bytes(width, "little")
        path = tmp_path / "m.gguf"
        path.write_bytes(bytes(mutated[:cut]))
        try:
            h = read_header(path)
        except SourceError as e:
            assert str(e).startswith(f"{path}: ") and "\n" not in str(e)
            return
        size = path.stat().st_size
        for t in h.tensors:
            assert t.data_offset + t.n_bytes <= size
            assert t.data.nbytes == t.n_bytes
        try:
            ref = gguf.GGUFReader(str(path))
        except Exception:  # gguf's reader refuses some headers llama.cpp reads (e.g. overlapping tensors)
            ref = None
        if ref is not None:  # (as text: NaN == NaN)
            assert repr(h.fields) == repr({k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")})
            assert [(t.name, t.tensor_type, t.data_offset, t.n_bytes) for t in h.tensors] == [
                (t.name, t.tensor_type, t.data_offset, t.n_bytes) for t in ref.tensors
            ]
        # (what the converter gives mx.load: files of the types it reads as stored; it segfaults on some fuzzed
        # headers of a Q4_K tensor, which it dequantises itself and the converter no longer gives it)
        if bytes(mutated[:cut]) != data and all(t.tensor_type.name in MX_LOAD_EXACT for t in h.tensors):
            passed.append(path.rename(tmp_path / f"passed-{len(passed)}.gguf"))

    check()
    # the fuzzing reaches mx.load, not only the check's refusals (10 of the derandomised examples alone, 9 after some
    # other tests in the same process: the bound keeps room for that)
    assert len(passed) >= 5
    r = subprocess.run([sys.executable, "-c", MX_LOAD_EACH, *map(str, passed)], capture_output=True, text=True)
    assert r.returncode == 0, f"mx.load died ({r.returncode}) after reading {r.stdout[-300:]}: {r.stderr[-2000:]}"


# -- signals ------------------------------------------------------------------------------------------------------
PAUSED_CONVERT = """
import sys, time
from mlx_flash.format.directory import FlashWriter
src, out, ready = sys.argv[1:]
real = FlashWriter.add_layer
def add(self, arrays):  # the first layer written, then wait to be signalled
    real(self, arrays)
    open(ready, "w").close()
    time.sleep(60)
FlashWriter.add_layer = add
from mlx_flash.convert.build import main
sys.argv = ["convert", "--model", src, "--out", out, "--dtype", "float16"]
main()
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_mid_way_removes_the_temporary_directory(tiny, tmp_path, sig):
    _, src, _ = tiny
    ready = tmp_path / "ready"
    p = subprocess.Popen(
        [sys.executable, "-c", PAUSED_CONVERT, str(src), str(tmp_path / "out"), str(ready)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # Ctrl-C's default: a test run started in the background (as CI may be) ignores SIGINT, and its children too
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        time.sleep(0.05)
    assert [n for n in leftovers(tmp_path) if n.startswith(".out.")], "no temporary directory mid-way"
    p.send_signal(sig)
    _, stderr = p.communicate(timeout=60)
    assert p.returncode == (128 + sig if sig == signal.SIGTERM else 1), (p.returncode, stderr)
    assert "Traceback" not in stderr, stderr
    assert leftovers(tmp_path) == []


KILLED_CONVERT = """
import os, signal, sys
from mlx_flash.format.directory import FlashWriter
real = FlashWriter.add_layer
def add(self, arrays):
    real(self, arrays)
    os.kill(os.getpid(), signal.SIGKILL)
FlashWriter.add_layer = add
from mlx_flash.convert import convert
convert(sys.argv[1], sys.argv[2], progress=False)
"""


def test_a_rerun_removes_what_a_killed_run_left(tiny, tmp_path):
    """SIGKILL cannot be caught: its temporary directory stays until the next conversion to the same --out, which
    removes it (its process is gone), and leaves alone one of a conversion still running."""
    _, src, _ = tiny
    r = subprocess.run([sys.executable, "-c", KILLED_CONVERT, str(src), str(tmp_path / "out")])
    assert r.returncode == -signal.SIGKILL
    (stale,) = leftovers(tmp_path)
    running = tmp_path / f".out.{os.getpid()}.running"  # this process's: alive
    running.mkdir()
    r = convert_cli("--model", src, "--out", tmp_path / "out", "--dtype", "float16")
    assert r.returncode == 0, r.stderr
    assert leftovers(tmp_path) == sorted(["out", running.name])


# -- a mistyped path ------------------------------------------------------------------------------------------
def test_a_mistyped_local_path_is_not_a_hub_id(tmp_path):
    r = convert_cli("--model", "models/smol.gguf", "--out", tmp_path / "out", cwd=tmp_path)
    assert_refused(r, "no such file or directory: models/smol.gguf")
    assert "Hub" not in r.stderr
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize(
    "src, hub",
    [
        ("models/smol.gguf", False),
        ("smol.gguf", False),
        ("model.safetensors", False),
        ("./models/smol", False),
        ("../smol", False),
        ("~/models/smol", False),
        ("/models/smol", False),
        ("models/smol/v2", False),
        ("models\\smol", False),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", True),
        ("org/name", True),  # also what a missing relative `models/smol` looks like: `./models/smol` is a path
        ("Qwen/Qwen2.5-0.5B", True),
    ],
)
def test_what_goes_to_the_hub(tmp_path, monkeypatch, src, hub):
    """An `org/name` that is no file or directory here is a Hub id; anything else that looks like a path and does
    not exist is refused as a missing path, with no Hub fetch."""
    import huggingface_hub

    fetched = []

    def fetch(repo_id, **kwargs):
        fetched.append(repo_id)
        raise OSError("offline")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fetch)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SourceError) as e:
        resolve_source(src, tmp_path)
    assert fetched == ([src] if hub else [])
    if not hub:
        assert str(e.value) == f"no such file or directory: {src}"


# -- a full disk ----------------------------------------------------------------------------------------------------
@contextmanager
def tmpfs(path, size):
    """A tmpfs of `size` bytes mounted at `path` (root only: the test is skipped elsewhere)."""
    path.mkdir()
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    except FileNotFoundError:
        pytest.skip("no mount command")
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield path
    finally:
        gc.collect()  # (files a failed conversion left open keep the mount busy)
        subprocess.run(["umount", "-l", str(path)], check=True)


def test_a_disk_too_small_is_refused_before_anything_is_written(tmp_path):
    """The default model's GGUF (94 MiB; about 100 MiB on disk at the conversion's peak) into 40 MiB: refused by the
    check, naming the sizes, not by ENOSPC mid-way; the filesystem is left empty."""
    from mlx_flash.default_model import default_gguf_path

    gguf_path = default_gguf_path()
    with tmpfs(tmp_path / "disk", 40 << 20) as disk:
        r = convert_cli("--model", gguf_path, "--out", disk / "out")
        assert_refused(r, "not enough disk space: needs about ", f" MiB free on {disk} for {disk / 'out'}, has 40 MiB")
        needs = int(re.search(r"needs about (\d+) MiB", r.stderr).group(1))
        size = gguf_path.stat().st_size >> 20  # (the output is about as large: the GGUF's blocks, repacked)
        assert size < needs < 1.5 * size, r.stderr  # (its mlx-lm directory freed as the output is written)
        assert os.listdir(disk) == [] and shutil.disk_usage(disk).used == 0


def test_a_gguf_converts_on_a_disk_of_its_output_and_a_twentieth(tmp_path, monkeypatch):
    """The default model's GGUF converts on a filesystem of 1.05 times its output (the space check off, so the
    filesystem bounds the peak): its mlx-lm directory is a shard per layer, each freed as its part of the output is
    written, and its FFN is converted a layer at a time into holes. The output is byte for byte the one converted
    with the FFN in that directory whole."""
    from mlx_flash.convert import build
    from mlx_flash.default_model import default_gguf_path

    gguf_path = str(default_gguf_path())
    real = build.resolve_source
    monkeypatch.setattr(build, "resolve_source", lambda *a, **k: real(*a, **{**k, "ffn_holes": False}))
    ref = build.convert(gguf_path, tmp_path / "ref", bits="auto", progress=False)
    monkeypatch.undo()
    size = sum(-(-f.stat().st_size // 4096) * 4096 for f in ref.iterdir())
    monkeypatch.setattr(build, "check_free_space", lambda out, needed: None)
    with tmpfs(tmp_path / "disk", int(1.05 * size)) as disk:
        out = build.convert(gguf_path, disk / "out", bits="auto", progress=False)
        assert os.listdir(disk) == ["out"]
        for name in ("ffn.bin", "resident.safetensors", "units.crc32", "config.json"):
            assert (out / name).read_bytes() == (ref / name).read_bytes(), name


def test_the_estimate_is_an_upper_bound_of_the_peak(tmp_path, monkeypatch):
    """The default model's GGUF converts on a filesystem of the estimate's size, and not on one 1.3 times smaller
    (check off): the estimate bounds the peak within 1.3x. There, ENOSPC mid-way is DiskSpaceError and nothing is
    left."""
    from mlx_flash.convert import build
    from mlx_flash.default_model import default_gguf_path

    gguf_path = default_gguf_path()
    needed = build._disk_needed(gguf_path, None, "auto", 64, False, None, "neurons", None)
    with tmpfs(tmp_path / "disk", needed) as disk:
        build.convert(str(gguf_path), disk / "out", bits="auto", progress=False)
        assert os.listdir(disk) == ["out"]
    monkeypatch.setattr(build, "check_free_space", lambda out, needed: None)
    with tmpfs(tmp_path / "small", int(needed / 1.3)) as disk:
        with pytest.raises(DiskSpaceError, match=f"No space left on device .*converting into {disk / 'out'}"):
            build.convert(str(gguf_path), disk / "out", bits="auto", progress=False)
        assert os.listdir(disk) == []


# Every file the conversion opens for writing in a folder is on a disk that is full once `budget` bytes are written.
FILLING_CONVERT = """
import builtins, errno, os, sys
budget, folder = int(sys.argv[1]), os.path.realpath(sys.argv[2])
real_open, written = builtins.open, [0]

class Filling:
    def __init__(self, f):
        self.f = f
    def __getattr__(self, name):
        return getattr(self.f, name)
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        self.f.close()
    def write(self, data):
        n = len(data.encode()) if isinstance(data, str) else memoryview(data).nbytes
        if written[0] + n > budget:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written[0] += n
        return self.f.write(data)

def filling_open(file, mode="r", *args, **kwargs):
    f = real_open(file, mode, *args, **kwargs)
    inside = isinstance(file, (str, os.PathLike)) and os.path.realpath(file).startswith(folder + os.sep)
    return Filling(f) if inside and any(c in mode for c in "wax+") else f

builtins.open = filling_open
from mlx_flash.convert.build import main
sys.argv = ["convert", *sys.argv[3:]]
main()
"""


@pytest.mark.parametrize(
    "budget_mib", [10, 100, 180], ids=["gguf-mlx-lm-directory", "ffn-layers", "resident.safetensors"]
)
def test_a_disk_filling_up_mid_way_ends_in_one_line(tmp_path, budget_mib):
    """ENOSPC while the default model's GGUF is converted (its mlx-lm directory, the FFN's layers, the resident
    weights): exit status 1, one line, no traceback; neither the output nor the temporary directory remains."""
    from mlx_flash.default_model import default_gguf_path

    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, "-c", FILLING_CONVERT, str(budget_mib << 20), str(tmp_path), "--model", default_gguf_path()]
        + ["--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr and "Exception" not in r.stderr, r.stderr
    (last,) = [line for line in r.stderr.splitlines() if "error" in line]  # (besides the progress bars)
    assert last.startswith("error: ") and last == r.stderr.rstrip().splitlines()[-1], r.stderr
    assert f"No space left on device (the disk filled up while converting into {out})" in last
    assert leftovers(tmp_path) == []
