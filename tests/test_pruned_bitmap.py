"""Wanda-pruned models stored bitmap-encoded (convert --prune wanda, format v2) run exactly like
the pruned model stored dense: same greedy tokens, encoded bytes read, clear errors."""

import json

from mlx_flash import FlashError
from mlx_flash.bench import resident_bytes
from mlx_flash.budget import min_budget
from mlx_flash.convert import convert
from mlx_flash.engine.sparsity import Oracle
from mlx_flash.errors import FlashFormatError
from mlx_flash.format.directory import FlashDir
from mlx_flash.loader import kv_size_of, load, load_resident
from mlx_flash.models.tiny import make_tiny_model_dir

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

PROMPT = [1, 5, 9, 33, 7, 100, 3]
CONTEXT = 256
PRUNE = dict(prune="wanda", prune_sparsity=0.5, prune_seqs=4, prune_seq_len=64, alignment=512, progress=False)
# name: (arch, model overrides, convert options). Units must span several 512 B blocks for the
# encoding to save reads: hence wider OPT (2 matrices) and 8-bit (ratio ~0.63 + dense scales) models.
VARIANTS = {
    "llama": ("llama", {}, {}),
    "opt": ("opt", {"hidden_size": 256}, {}),
    "llama-q8": ("llama", {"hidden_size": 512}, {"bits": 8, "group_size": 64}),
    "llama-f16": ("llama", {"hidden_size": 256}, {"dtype": "float16"}),
    "llama-bf16": ("llama", {"hidden_size": 256}, {"dtype": "bfloat16"}),
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pruned")
    out = {"src": {}}
    for name, (arch, model_kw, kw) in VARIANTS.items():
        src = out["src"][name] = make_tiny_model_dir(arch, root / f"src-{name}", **model_kw)
        for fmt in ("dense", "bitmap"):
            out[name, fmt] = convert(str(src), root / f"{name}-{fmt}", prune_format=fmt, **PRUNE, **kw)
    return out


def _bits(a):
    """numpy bit patterns of an mx.array (numpy has no bfloat16)."""
    return np.array(mx.view(a, mx.uint16) if a.dtype in (mx.bfloat16, mx.float16) else a)


def greedy(model, n=24):
    return [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=n)]


def test_format_and_pruning(dirs):
    for name in VARIANTS:
        dense, enc = FlashDir(dirs[name, "dense"]), FlashDir(dirs[name, "bitmap"])
        assert (dense.version, enc.version) == (3, 3)  # packed units (v3); padded, they stay v1 and v2: below
        ld, le = dense.layouts["neurons"], enc.layouts["neurons"]
        assert le.stride == ld.stride and ld.disk_stride == ld.stride  # cache rows stay dense
        assert le.disk_stride < ld.stride and le.disk_nbytes < 0.8 * ld.nbytes
        assert enc.ffn_bytes < dense.ffn_bytes
        for c in le.components:
            assert (c.encoding is not None) == c.name.endswith(".weight")
        enc.verify()
        # the encoded layers expand to exactly the dense layers, and rows are 50% pruned
        for i in range(len(enc.layers)):
            a, b = dense.unpack_layer(i), enc.unpack_layer(i)
            for k in a:
                assert np.array_equal(_bits(a[k]), _bits(b[k])), (name, i, k)
        if name != "llama-q8":
            for k, w in a.items():
                d, w = w.shape[-1], _bits(w)
                assert ((w != 0).sum(axis=1) <= d - d // 2).all()
                assert (w == 0).mean() >= 0.5


@pytest.mark.parametrize("name", list(VARIANTS))
def test_bitmap_generates_like_pruned_dense(dirs, name):
    """Under a budget that evicts; prompt streaming, misses and the resident reference all expand."""
    ref, _ = load_resident(dirs[name, "dense"])
    expected = greedy(ref)
    enc_ref, _ = load_resident(dirs[name, "bitmap"])
    assert greedy(enc_ref) == expected
    runs = {}
    for fmt in ("dense", "bitmap"):
        path = dirs[name, fmt]
        fd = FlashDir(path)
        # same for both; the oracle's own copy of gate/up is in the budget too
        budget = (
            min_budget(fd, CONTEXT, kv_size_of(fd), resident=resident_bytes(fd))
            + int(0.1 * FlashDir(dirs[name, "dense"]).ffn_bytes)
            + Oracle(fd).nbytes
        )
        # density 0.25: GLU oracles default to every neuron, which would only exercise overflow
        model, _ = load(path, memory_budget=budget, sparsity="oracle", density=0.25, context=CONTEXT)
        try:
            assert 0 < model.flash.plan.capacity[0]["neurons"] < fd.layers[0]["neurons"].n_units / 5
            runs[fmt] = greedy(model)
            model.flash.stats.end()
            toks = model.flash.stats.tokens
            # every cache row holds exactly the pruned dense unit of its neuron
            dense_fd = FlashDir(dirs[name, "dense"])
            caches = [regions["neurons"] for regions in model.flash.caches]
            # misses were admitted to the cache (the expand-into-cache path), others evicted for them
            assert sum(c.stats.misses for c in caches) > 0 and sum(c.stats.evicted for c in caches) > 0
            for i, regions in enumerate(model.flash.caches):
                c = regions["neurons"]
                units = dense_fd.read_region(i)[c.slot_to_unit[: c.num_used]]
                assert c.num_used > 0 and np.array_equal(c.host[: c.num_used], units), (fmt, i)
        finally:
            model.flash.close()
        stride = fd.layouts["neurons"].disk_stride
        n_units = sum(r.n_units for r in fd.regions())
        decode = [t for t in toks if not t.prefill]
        assert sum(t.misses for t in decode) > 0  # caches evicted and reloaded
        assert toks[0].prefill and toks[0].bytes_requested == n_units * stride  # the prompt streams every unit once
        for t in decode:
            assert t.bytes_requested == t.misses * stride  # the encoded bytes, per miss
            assert (t.expand_s > 0) == (fmt == "bitmap" and t.misses > 0)
    assert runs["bitmap"] == runs["dense"]  # (sparse: not the resident model's tokens)


def test_bitmap_dense_sparsifier_streams_overflow(dirs):
    """The dense sparsifier (every neuron, every token) overflows the small cache: overflow units
    are streamed and expanded through the scratch buffer."""
    path = dirs["llama", "bitmap"]
    ref, _ = load_resident(path)
    fd = FlashDir(path)
    model, _ = load(
        path,
        memory_budget=min_budget(fd, CONTEXT, kv_size_of(fd), resident=resident_bytes(fd)) + int(0.05 * fd.ffn_bytes),
        sparsity="dense",
        context=CONTEXT,
    )
    try:
        assert greedy(model, 8) == greedy(ref, 8)
        model.flash.stats.end()
        n = fd.layers[0]["neurons"].n_units * len(fd.layers)
        for t in model.flash.stats.decode_tokens():
            assert t.hits + t.misses == n and t.bytes_requested == t.misses * fd.layouts["neurons"].disk_stride
    finally:
        model.flash.close()


def test_reorder_keeps_the_encoding(dirs, tmp_path):
    from mlx_flash.calib.reorder import reorder

    path = _copy(dirs, tmp_path)
    before = FlashDir(path)
    ref, _ = load_resident(path)
    expected = greedy(ref, 8)
    rng = np.random.default_rng(0)
    reorder(path, [rng.permutation(r["neurons"].n_units) for r in before.layers])
    after = FlashDir(path)
    assert after.version == before.version and after.layouts == before.layouts
    model, _ = load_resident(path)
    assert greedy(model, 8) == expected


def _edit_manifest(path, edit):
    m = json.loads((path / "flash.json").read_text())
    edit(m)
    (path / "flash.json").write_text(json.dumps(m))


def _copy(dirs, tmp_path, name="llama"):
    import shutil

    return shutil.copytree(dirs[name, "bitmap"], tmp_path / "copy")


def _first_encoding(m):
    return next(c for c in m["layouts"]["neurons"]["components"] if "encoding" in c)["encoding"]


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: _first_encoding(m).update(kind="zstd"), "unknown encoding 'zstd'"),
        (lambda m: _first_encoding(m).update(fill="ones"), "bad bitmap encoding"),
        (lambda m: _first_encoding(m).update(capacity=10**6), "bad bitmap encoding"),
        (lambda m: _first_encoding(m).update(length=100), "its encoding holds 100 values"),
        (lambda m: m.update(format_version=1), "encoded components need format version 2"),
        (lambda m: m["layouts"]["neurons"].pop("disk_stride"), "no disk_stride"),
    ],
)
def test_bad_encoding_is_a_clear_error(dirs, tmp_path, edit, message):
    path = _copy(dirs, tmp_path)
    _edit_manifest(path, edit)
    with pytest.raises(FlashFormatError, match=message):
        FlashDir(path)


def _drop_scales(m):
    comps = m["layouts"]["neurons"]["components"]
    comps[:] = [c for c in comps if c["name"] != "gate.scales"]


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda m: _first_encoding(m).update(group_size=16),
            "affine_zero fill needs a dense 'gate.scales' of 32 groups",
        ),
        (_drop_scales, "affine_zero fill needs a dense 'gate.scales'"),
        (lambda m: _first_encoding(m).update(dtype="float16"), "affine_zero fill needs uint8 values"),
    ],
)
def test_bad_affine_encoding_is_a_clear_error(dirs, tmp_path, edit, message):
    path = _copy(dirs, tmp_path, "llama-q8")
    _edit_manifest(path, edit)
    with pytest.raises(FlashFormatError, match=message):
        FlashDir(path)


def test_corrupted_encoded_bytes(dirs, tmp_path):
    path = _copy(dirs, tmp_path)
    fd = FlashDir(path)
    r = fd.layers[1]["neurons"]
    with open(path / "ffn.bin", "r+b") as f:
        f.seek(r.offset + 3 * r.stride + 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(FlashFormatError, match="checksum mismatch in layer 1"):
        FlashDir(path).verify()


def test_v1_directory_still_loads(dirs, tmp_path):
    """A directory written as before format v2 (no encodings, units padded: version 1) loads and generates; so does a
    pruned one written as v2 (encoded, padded)."""
    src = dirs["src"]["llama"]
    path = convert(str(src), tmp_path / "v1", alignment=512, unit_alignment=None, progress=False)
    m = json.loads((path / "flash.json").read_text())
    assert m["format_version"] == 1 and "disk_stride" not in m["layouts"]["neurons"]
    assert all("encoding" not in c and "disk_offset" not in c for c in m["layouts"]["neurons"]["components"])
    v2 = convert(str(src), tmp_path / "v2", unit_alignment=None, prune_format="bitmap", **PRUNE)
    assert FlashDir(v2).version == 2
    ref, fd = load_resident(path)
    model, _ = load(
        path,
        memory_budget=min_budget(fd, CONTEXT, kv_size_of(fd), resident=resident_bytes(fd))
        + int(0.1 * fd.ffn_bytes)
        + Oracle(fd).nbytes,
        sparsity="oracle",
        context=CONTEXT,
    )
    try:
        assert greedy(model, 8) == greedy(ref, 8)
    finally:
        model.flash.close()


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"bits": 4, "group_size": 32, "prune_format": "bitmap"}, "4-bit codes are packed"),
        ({"layout": "dip"}, "--prune needs --layout neurons"),
        ({"prune_sparsity": 1.0}, "--prune-sparsity must be in"),
        ({"prune": "sparsegpt"}, "--prune must be one of"),
        ({"prune_text": "/nonexistent/text.txt"}, "--prune-text"),
    ],
)
def test_bad_prune_options(dirs, tmp_path, kw, message):
    with pytest.raises(FlashError, match=message):
        convert(str(dirs["src"]["llama"]), tmp_path / "x", **dict(PRUNE, **kw))
    assert not (tmp_path / "x").exists()


def test_cli(dirs, tmp_path):
    import subprocess
    import sys

    out = tmp_path / "cli"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_flash.convert",
            "--model",
            str(dirs["src"]["llama"]),
            "--out",
            str(out),
            "--prune",
            "wanda",
            "--prune-sparsity",
            "0.6",
            "--prune-seqs",
            "2",
            "--prune-seq-len",
            "32",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert "B expanded" in r.stdout
    fd = FlashDir(out)
    assert fd.manifest["pruning"]["sparsity"] == 0.6 and fd.manifest["pruning"]["calibration"]["seqs"] == 2
    assert {e.capacity for e in fd.layouts["neurons"].encodings().values()} == {64 - int(0.6 * 64)}
    q4 = [
        sys.executable,
        "-m",
        "mlx_flash.convert",
        "--model",
        str(dirs["src"]["llama"]),
        "--bits",
        "4",
        "--prune",
        "wanda",
        "--prune-seqs",
        "2",
        "--prune-seq-len",
        "32",
    ]
    r = subprocess.run(q4 + ["--out", str(tmp_path / "q4"), "--prune-format", "bitmap"], capture_output=True, text=True)
    assert (
        r.returncode == 1 and "4-bit codes are packed" in r.stderr and "calibrate" not in r.stderr
    )  # before calibrating
    r = subprocess.run(q4 + ["--out", str(tmp_path / "q4")], capture_output=True, text=True)  # auto: the default
    assert r.returncode == 0, r.stderr
    assert "gate: 4-bit rows cannot be bitmap-encoded: stored pruned but dense" in r.stderr
    assert set(FlashDir(tmp_path / "q4").layouts["neurons"].encodings()) == {"down.weight"}  # 8-bit down: encoded
