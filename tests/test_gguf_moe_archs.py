"""More MoE GGUFs as llama.cpp writes them (mlx_flash.tools.synthetic_gguf.tiny_moe: the tensor names of gguf-py's
MODEL_TENSORS for the architecture, the metadata keys of llama.cpp's converter, Q4_0 weights, float32 routers and
norms): converted, every weight is the GGUF tensor's values, and streamed at one expert slot per layer the greedy
tokens are the resident model's. benchmarks/moe_gguf_check.py checks the same files against llama-perplexity.
Architectures mlx_flash cannot convert are refused in one line naming what stops them."""

import json
import re

import mlx_flash  # noqa: F401
from mlx_flash.budget import min_budget
from mlx_flash.convert.build import convert
from mlx_flash.convert.gguf import gguf_to_mlx_dir, read_header
from mlx_flash.convert.gguf_archs import Meta, arch_spec, is_mtp, map_name
from mlx_flash.engine.experts import REGION
from mlx_flash.errors import UnsupportedArchitectureError
from mlx_flash.format.directory import FlashDir
from mlx_flash.generate import generate_step
from mlx_flash.loader import kv_size_of, load
from mlx_flash.tools.synthetic_gguf import GGUF_ARCHS, tiny_moe, write_gguf

import gguf
import mlx.core as mx
import numpy as np
import pytest

PROMPT = mx.array([1, 5, 9, 33, 70, 2, 11])
CONTEXT = 64

# mlx-lm model_type -> what the file holds beyond qwen3moe's blocks (tests/test_moe.py has the first six)
ARCHS = {
    "glm4_moe": "q/k/v biases, half-rotary heads, a dense first layer, sigmoid routing with exp_probs_b, a shared "
    "expert, the MTP block (nextn) left out",
    "dots1": "q/k norms, a dense first layer, sigmoid routing with exp_probs_b, a shared expert",
    "minimax": "q/k norms over all heads, a rotary part of each head, sigmoid routing with exp_probs_b",
    "granitemoe": "Granite's four multipliers, RoPE-permuted q/k, the head tied to the embedding",
    "ernie4_5_moe": "a dense first layer, softmax routing renormalised over the top k, a shared expert",
    "llama4": "MoE and dense layers alternating, top-1 sigmoid routing, a shared expert, a layer without RoPE",
    "qwen3_next": "gated DeltaNet layers (in_proj_qkvz split in two, A_log as -exp) and a full-attention one with an "
    "output gate, a shared expert behind a sigmoid gate",
    "qwen3_5_moe": "Qwen3-Next's layers with separate projections, value heads stored tiled",
    "hunyuan_moe": "q/k norms after RoPE, an ungated shared MLP, softmax routing renormalised over the top k "
    "(mlx_flash's hunyuan_moe), the head tied to the embedding",
    "deepseek_v32": "deepseek2's MLA and grouped sigmoid routing, the lightning indexer choosing 24 keys per query",
}
# llama.cpp architecture -> (the mlx-lm model_type of the same architecture, what the one-line refusal names)
REFUSED = {
    "ernie4_5-moe": ("ernie4_5_moe", "exp_probs_b"),  # (with one)
}


def _gguf_tensor_names(arch: str) -> list:
    """gguf-py's names of the architecture's tensors, as patterns ("blk.{bid}.attn_q" -> blk.N.attn_q)."""
    extra = []
    if arch == "deepseek32" and arch not in gguf.MODEL_ARCH_NAMES.values():  # (gguf-py 0.19 predates it)
        arch, extra = "deepseek2", [t for t in gguf.MODEL_TENSOR if t.name.startswith("INDEXER_")]
    (key,) = [k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch]
    names = [gguf.TENSOR_NAMES[t] for t in [*gguf.MODEL_TENSORS[key], *extra]]
    suffix = r"(\.weight|\.bias)?"  # (ssm_a has none)
    return [re.compile(re.escape(n).replace(r"\{bid\}", r"\d+") + suffix) for n in names]


def _unpermute(a: np.ndarray, n_head: int) -> np.ndarray:
    return a.reshape(n_head, a.shape[0] // n_head // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


def _reorder_v_heads(a: np.ndarray, axis: int, c: dict, dim: int) -> np.ndarray:
    """llama.cpp's _LinearAttentionVReorderBase._reorder_v_heads: value heads grouped by key head -> tiled."""
    n_k, per_k = c["linear_num_key_heads"], c["linear_num_value_heads"] // c["linear_num_key_heads"]
    a = np.moveaxis(a, axis, 0)
    t = a.reshape(n_k, per_k, dim, *a.shape[1:]).swapaxes(0, 1).reshape(a.shape)
    return np.moveaxis(t, 0, axis)


def _as_llama_cpp_writes(model_type: str, kind: str, a: np.ndarray) -> np.ndarray:
    """A converted gated DeltaNet weight (mlx-lm's layout) as llama.cpp's converter writes GGUF tensor `kind`
    (convert_hf_to_gguf.py's Qwen3NextModel, _LinearAttentionVReorderBase), or `a` itself."""
    if model_type not in ("qwen3_next", "qwen3_5_moe"):
        return a
    c = tiny_moe(model_type)
    n_k, n_v, d_k, d_v = (
        c[f"linear_{k}"] for k in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim")
    )
    key_dim = n_k * d_k
    if kind == "ssm_a":
        a = -np.exp(a)
    if kind == "ssm_conv1d":
        a = a.squeeze(-1)
    if model_type == "qwen3_next" and kind in ("attn_qkv", "attn_gate"):  # in_proj_qkvz split
        split = np.cumsum([d_k, d_k, n_v // n_k * d_v])
        q, k, v, z = np.split(a.T.reshape(c["hidden_size"], n_k, -1), split, axis=-1)
        if kind == "attn_gate":
            return z.reshape(c["hidden_size"], -1).T
        return np.concatenate([x.reshape(c["hidden_size"], -1) for x in (q, k, v)], axis=-1).T
    if model_type == "qwen3_5_moe":
        if kind in ("attn_qkv", "ssm_conv1d"):
            return np.concatenate([a[: 2 * key_dim], _reorder_v_heads(a[2 * key_dim :], 0, c, d_v)])
        if kind in ("attn_gate", "ssm_out"):
            return _reorder_v_heads(a, 0 if kind == "attn_gate" else 1, c, d_v)
        if kind in ("ssm_alpha", "ssm_beta", "ssm_a", "ssm_dt"):
            return _reorder_v_heads(a, 0, c, 1)
    return a


def _converted(weights: dict, name: str, quant: dict) -> np.ndarray:
    """A weight of the converted directory as float32 values (dequantised in float32: exactly Q4_0's d * (q - 8))."""
    stem = name[: -len(".weight")]
    if f"{stem}.scales" not in weights:
        return np.array(weights[name].astype(mx.float32))
    s, b = (weights[f"{stem}.{k}"].astype(mx.float32) for k in ("scales", "biases"))
    q = quant.get(stem, quant)
    return np.array(mx.dequantize(weights[name], s, b, group_size=q["group_size"], bits=q["bits"]))


@pytest.fixture(scope="module", params=sorted(ARCHS))
def converted(request, tmp_path_factory):
    """(model_type, the GGUF, its mlx-lm directory, its flash directory)."""
    root = tmp_path_factory.mktemp(request.param)
    path = write_gguf("moe-small", root / "m.gguf", progress=False, **tiny_moe(request.param))
    return request.param, path, gguf_to_mlx_dir(path, root / "mlx"), convert(str(path), root / "flash", progress=False)


def test_weights_are_the_gguf_tensors(converted):
    """Every tensor has a name of gguf-py's for the architecture, and each converted weight is its values (RoPE rows
    unpermuted where llama.cpp permutes them; the gated DeltaNet rearrangements of llama.cpp's converter undone);
    the MTP block's tensors are left out."""
    model_type, path, mlx_dir, _ = converted
    reader = gguf.GGUFReader(path)
    arch = GGUF_ARCHS[model_type]
    meta = Meta(read_header(path).fields, path)
    spec = arch_spec(arch, meta)
    patterns = _gguf_tensor_names(arch)
    weights = mx.load(str(mlx_dir / "model.safetensors"))
    quant = json.loads((mlx_dir / "config.json").read_text()).get("quantization", {})
    checked = set()
    for t in reader.tensors:
        assert any(p.fullmatch(t.name) for p in patterns), t.name
        base, _, part = t.name.rpartition(".")
        if part not in ("weight", "bias"):  # (ssm_a)
            base, part = t.name, "weight"
        if is_mtp(spec, meta, base):
            continue
        want = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        hf, head_key = map_name(spec, base)
        if head_key is not None:
            want = _unpermute(want, meta.int(f"{arch}.{head_key}"))
        name = hf if base.rpartition(".")[2] in spec.bare else f"{hf}.{part}"
        kind = base.rpartition(".")[2]
        got = _as_llama_cpp_writes(model_type, kind, _converted(weights, name, quant))
        if kind in spec.row_vectors:  # (a Linear's one row in mlx-lm)
            got = got.reshape(-1)
        if kind == "ssm_a":  # (log, then exp: within float32's rounding)
            assert got.shape == want.shape and np.allclose(got, want, rtol=1e-6, atol=0), t.name
        else:
            assert got.shape == want.shape and np.array_equal(got, want), t.name
        checked.add(name)
    assert checked == {k for k in weights if not k.endswith((".scales", ".biases"))}
    assert any("nextn" in t.name for t in reader.tensors) == (model_type == "glm4_moe")


def test_streamed_tokens_are_the_resident_models(converted):
    """Greedy tokens with every expert cached, and streamed under a budget of one expert slot per layer, agree."""
    flash_dir = converted[3]
    fd = FlashDir(flash_dir)
    stride = sum(REGION in layer for layer in fd.layers) * fd.layouts[REGION].stride
    tokens = []
    for budget in (None, min_budget(fd, CONTEXT, kv_size_of(fd)) + stride):
        model, _ = load(flash_dir, memory_budget=budget, context=CONTEXT)
        try:
            tokens.append([int(t) for t, _ in generate_step(PROMPT, model, max_tokens=12)])
            slots = {c[REGION] for c in model.flash.plan.capacity if REGION in c}
            assert budget is None or max(slots) < fd.ffn["n_experts"]  # (streamed: not every expert cached)
        finally:
            model.flash.close()
    assert tokens[0] == tokens[1]


def test_hunyuan_routes_with_the_top_k_renormalised(tmp_path):
    """hunyuan_moe's MoE block weights a token's experts by their softmax scores divided by their sum (as llama.cpp
    and Hunyuan's reference do), where mlx-lm's hunyuan takes the scores as they are."""
    from mlx_flash.convert.source import load_source_model

    path = write_gguf("moe-small", tmp_path / "m.gguf", progress=False, **tiny_moe("hunyuan_moe"))
    model, _ = load_source_model(gguf_to_mlx_dir(path, tmp_path / "mlx"), lazy=False)
    block = model.model.layers[0].mlp
    x = mx.random.normal((1, 5, model.args.hidden_size), key=mx.random.key(0))
    gates = mx.softmax(block.gate(x), axis=-1, precise=True)
    inds = mx.argsort(-gates, axis=-1)[..., : block.top_k]
    scores = mx.take_along_axis(gates, inds, axis=-1)
    want = (block.switch_mlp(x, inds) * (scores / scores.sum(-1, keepdims=True))[..., None]).sum(-2)
    want = want + block.shared_mlp(x)
    assert block.top_k < block.num_experts and mx.allclose(block(x), want, rtol=1e-5, atol=1e-5).item()
    unnormalised = (block.switch_mlp(x, inds) * scores[..., None]).sum(-2) + block.shared_mlp(x)
    assert not mx.allclose(block(x), unnormalised, rtol=1e-3, atol=1e-3).item()


def test_qwen35moe_with_one_value_head_per_key_head(tmp_path):
    """As many value heads as key heads: nothing to untile, and attn_qkv / attn_gate stay apart (in_proj_qkv, in_proj_z)
    as they are in the GGUF."""
    c = {**tiny_moe("qwen3_5_moe"), "linear_num_value_heads": 2}
    path = write_gguf("moe-small", tmp_path / "m.gguf", progress=False, **c)
    out = gguf_to_mlx_dir(path, tmp_path / "mlx")
    weights = mx.load(str(out / "model.safetensors"))
    quant = json.loads((out / "config.json").read_text())["quantization"]
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for gguf_name, name in (("attn_qkv", "in_proj_qkv"), ("attn_gate", "in_proj_z"), ("ssm_out", "out_proj")):
        t = tensors[f"blk.0.{gguf_name}.weight"]
        got = _converted(weights, f"language_model.model.layers.0.linear_attn.{name}.weight", quant)
        assert np.array_equal(got, gguf.quants.dequantize(t.data, t.tensor_type)), gguf_name


def _float_copy(src, dst, floats) -> None:
    """A copy of the GGUF `src` with the tensors whose names contain one of `floats` ("": all) dequantised to F32."""
    from gguf.quants import dequantize

    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), r.fields[gguf.Keys.General.ARCHITECTURE].contents())
    for f in r.fields.values():
        if f.name != gguf.Keys.General.ARCHITECTURE and not f.name.startswith("GGUF."):
            sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)
    for t in r.tensors:
        if any(x in t.name for x in floats):
            w.add_tensor(t.name, dequantize(t.data, t.tensor_type).astype(np.float32))
        else:
            w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_moe"])
@pytest.mark.parametrize("floats", [("",), ("attn_gate", "ssm_out")])
def test_deltanet_tensors_in_float_convert_to_the_same_values(model_type, floats, tmp_path):
    """The gated DeltaNet rearrangements on float tensors (every tensor F32, or attn_gate and ssm_out alone beside
    Q4_0 ones: qwen3next's attn_qkv and attn_gate joined across two types) give the Q4_0 file's values."""
    src = write_gguf("moe-small", tmp_path / "q.gguf", progress=False, **tiny_moe(model_type))
    _float_copy(src, tmp_path / "f.gguf", floats)
    got = {}
    for name in ("q", "f"):
        out = gguf_to_mlx_dir(tmp_path / f"{name}.gguf", tmp_path / name)
        weights = mx.load(str(out / "model.safetensors"))
        quant = json.loads((out / "config.json").read_text()).get("quantization", {})
        got[name] = {k: _converted(weights, k, quant) for k in weights if not k.endswith((".scales", ".biases"))}
    assert got["q"].keys() == got["f"].keys()
    for k, want in got["q"].items():
        assert np.array_equal(got["f"][k], want), k


@pytest.mark.parametrize("arch", sorted(REFUSED))
def test_refused_in_one_line(arch, tmp_path):
    path = tmp_path / f"{arch}.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.add_tensor("blk.0.exp_probs_b.bias", np.zeros(8, np.float32))  # (ERNIE's correction bias)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedArchitectureError, match=REFUSED[arch][1]) as e:
        gguf_to_mlx_dir(path, tmp_path / "out")
    assert "\n" not in str(e.value)
