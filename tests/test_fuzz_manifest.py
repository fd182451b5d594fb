"""FlashDir over mutated manifests: every outcome is a typed error (FlashFormatError) or a directory that opens,
verifies and computes a token (or refuses to load with a FlashError), never another exception, a crash or a hang."""

import json
import math
import os
import tempfile
from pathlib import Path

from mlx_flash import load
from mlx_flash.convert import convert
from mlx_flash.errors import FlashError, FlashFormatError
from mlx_flash.format.directory import MANIFEST, FlashDir
from mlx_flash.models.tiny import make_tiny_model_dir
from mlx_flash.tools.synthetic import tiny_quantized

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st


@pytest.fixture(
    scope="module", params=["llama", "qwen3_moe", "qwen3_moe in place", "qwen3_moe in place Q4_K_M", "qwen3_moe copied"]
)
def flash_dir(request, tmp_path_factory):
    """A dense and a mixture-of-experts directory, and ones whose experts are read in place from a 4-bit source or a
    Q4_K_M GGUF's blocks (format v5: sources and extents; GGML types per layer, extents' own lengths), or from those
    blocks copied into the directory's own ffn.bin (convert --copy: sources.root ".")."""
    from mlx_flash.tools.synthetic_gguf import tiny_moe, write_gguf

    root = tmp_path_factory.mktemp("fuzz")
    arch, *form = request.param.split(" ", 1)
    if form in (["in place Q4_K_M"], ["copied"]):  # (K-quant blocks: rows of 256 values)
        shape = dict(hidden_size=256, moe_intermediate_size=256, num_hidden_layers=4)
        src = write_gguf(
            "moe-small", root / "m.gguf", progress=False, gguf_type="Q4_K_M", **{**tiny_moe(arch), **shape}
        )
    elif form:
        src = tiny_quantized(arch, root / "src")
    else:
        src = make_tiny_model_dir(arch, root / "src")
    out = convert(str(src), root / "flash", alignment=512, progress=False, copy=form == ["copied"])
    assert (FlashDir(out).sources is not None) == bool(form)
    return out


def paths(obj, at=()):
    """Every path to a value of a JSON tree."""
    yield at
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        yield from paths(v, at + (k,))


VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 1, 511, 512, 4096, 2**31, 2**63, math.inf, -math.inf, math.nan]),
    st.floats(allow_nan=True),
    st.text(max_size=12),
    st.sampled_from(["../x", "/etc/passwd", "ffn.bin", "resident.safetensors", "neurons", "glu", "uint8"]),
    st.lists(st.integers(min_value=-5, max_value=5000), max_size=4),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
)


def test_the_unmutated_directory_opens(flash_dir):
    FlashDir(flash_dir).verify()


@settings(max_examples=300, deadline=5000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_manifests_open_or_raise_a_typed_error(flash_dir, data):
    manifest = json.loads((flash_dir / MANIFEST).read_text())
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        at = data.draw(st.sampled_from(list(paths(manifest))[1:]), label="path")
        parent = manifest
        for k in at[:-1]:
            parent = parent[k]
        if data.draw(st.booleans(), label="delete") and isinstance(parent, dict):
            del parent[at[-1]]
        else:
            parent[at[-1]] = data.draw(VALUES, label="value")
    with tempfile.TemporaryDirectory() as d:
        for f in flash_dir.iterdir():
            if f.name != MANIFEST:
                os.symlink(f, Path(d) / f.name)
        (Path(d) / MANIFEST).write_text(json.dumps(manifest))
        try:
            fd = FlashDir(d)
            fd.verify()
            fd.resident_index()
            fd.load_predictors()
        except FlashFormatError:
            event("refused at open")
            return
        try:  # what opens also loads and computes a token, or says why not
            model, _ = load(d, context=16)
            model(mx.array([[1, 2, 3]]))
            model.flash.close()
            event("loaded")
        except FlashError:
            event("refused at load")


@pytest.mark.parametrize("field,value", [("group_size", 0), ("group_size", 2**31), ("group_size", 48), ("bits", 7)])
def test_an_experts_quantisation_that_does_not_fit_is_refused(flash_dir, tmp_path, field, value):
    """(Found by the fuzz above on a quantised MoE:) an expert matrix's group size or bits that its codes and scales
    do not have is refused at open, not handed to the kernels."""
    manifest = json.loads((flash_dir / MANIFEST).read_text())
    quant = manifest["ffn"].get("quantization") or {}
    if not any(q and "bits" in q for q in quant.values()):
        pytest.skip("no affine quantised experts")
    next(q for q in quant.values() if q)[field] = value
    with pytest.raises(FlashFormatError, match="does not fit its codes and scales"):
        FlashDir(_with_manifest(flash_dir, tmp_path, manifest))


def _with_manifest(flash_dir, tmp_path, manifest):
    d = tmp_path / "flash"
    d.mkdir()
    for f in flash_dir.iterdir():
        if f.name != MANIFEST:
            os.symlink(f, d / f.name)
    (d / MANIFEST).write_text(json.dumps(manifest))
    return d


@pytest.mark.parametrize(
    "field,value,why",
    [
        ("values", 0, "components do not match"),
        ("values", 48, "multiples of 256"),
        ("values", 2**31, "do not hold"),
        ("ggml", "Q7_K", "one of Q4_0"),
        ("ggml", {"0": "Q4_K"}, "one of Q4_0"),
        ("ggml", "Q6_K", "do not hold"),
        ("bits", 4, "components do not match"),
    ],
)
def test_an_experts_ggml_type_that_does_not_fit_is_refused(flash_dir, tmp_path, field, value, why):
    """An expert matrix of GGML blocks whose type, width or fields its rows do not have is refused at open."""
    manifest = json.loads((flash_dir / MANIFEST).read_text())
    quant = manifest["ffn"].get("quantization") or {}
    if not any(q and "ggml" in q for q in quant.values()):
        pytest.skip("no experts of GGML blocks")
    quant["gate_proj"][field] = value
    with pytest.raises(FlashFormatError, match=why):
        FlashDir(_with_manifest(flash_dir, tmp_path, manifest))


@pytest.mark.parametrize("value", [{"": 0}, {"model.no_such_module": 4}], ids=["zero-bits", "no-module"])
def test_a_symmetric_list_that_is_not_the_files_is_refused(flash_dir, tmp_path, value):
    """(Found by the fuzz above:) resident.symmetric naming no module, or bits that are none, is a FlashFormatError
    at open or load, not a KeyError; null where it lists nothing opens (it was a TypeError)."""
    manifest = json.loads((flash_dir / MANIFEST).read_text())
    listed = manifest["resident"].get("symmetric")
    manifest["resident"]["symmetric"] = value
    with pytest.raises(FlashFormatError, match="resident.symmetric"):
        d = _with_manifest(flash_dir, tmp_path, manifest)
        FlashDir(d).load_resident()
        load(d, context=16)
    if not listed:
        manifest["resident"]["symmetric"] = None
        (tmp_path / "null").mkdir()
        FlashDir(_with_manifest(flash_dir, tmp_path / "null", manifest)).load_resident()


@pytest.mark.parametrize(
    "value",
    [
        {"model.no_such_module": "Q6_K"},
        {"model.embed_tokens": "Q7_K"},
        {"model.norm": "Q6_K"},
        {"lm_head": 6},
        {"model.layers.0.self_attn.k_proj": "Q8_0"},
    ],
    ids=["no-module", "no-type", "not-a-matrix", "not-a-name", "not-its-weights"],
)
def test_a_blocks_list_that_is_not_the_models_is_refused(flash_dir, tmp_path, value):
    """resident.blocks (matrices kept as GGML blocks) naming no module, no block type, a module that is no linear
    layer or embedding, or one whose stored weights are not blocks is a FlashFormatError, at open or load."""
    manifest = json.loads((flash_dir / MANIFEST).read_text())
    manifest["resident"]["blocks"] = value
    with pytest.raises(FlashFormatError, match=r"resident\.(blocks|symmetric)|do not match the architecture"):
        d = _with_manifest(flash_dir, tmp_path, manifest)
        load(d, context=16)


@pytest.mark.parametrize("value", [3, 1024])
def test_an_alignment_its_units_do_not_keep_is_refused(flash_dir, tmp_path, value):
    """(Found by the fuzz above on experts read in place:) an alignment that is no power of two, or that the regions or
    the units' cache rows do not keep, is refused at open, not handed to the unit caches (a ValueError there); one they
    keep loads."""
    manifest = json.loads((flash_dir / MANIFEST).read_text())
    manifest["alignment"] = value
    d = _with_manifest(flash_dir, tmp_path, manifest)
    try:
        FlashDir(d).verify()
    except FlashFormatError:
        return
    assert value != 3
    model, _ = load(d, context=16)
    model.flash.close()
