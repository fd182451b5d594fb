"""Synthetic flash directories: exact shapes of a larger model, random weights.

    python -m mlx_flash.tools.synthetic --preset llama-7b [--storage q4|float16] [--out DIR]

Built once and cached under ~/.cache/mlx_flash/synthetic/<preset>[-<storage>] ($MLX_FLASH_CACHE
moves the root). Written with FlashWriter layer by layer, so memory stays at one layer of bundles
plus the resident part; the directory appears (renamed from a temporary name) only when complete.

Storage:
  q4      (default) gate/up 4-bit and down 8-bit per neuron (group 64), as `convert` stores a 4-bit
          model; the resident part (attention, embeddings, lm_head) 4-bit, norms float16.
  float16 everything float16 (a 7B FFN is ~8.6 GB: slow to build).
Weights are random bytes with small positive scales and centring biases, so activations stay finite;
tokens are meaningless: only the timings and bytes matter. The tokenizer is the byte-level one of the
tiny test models. Alignment 512 (O_DIRECT's minimum on this disk) so bundles are not padded
(7B q4: 9216 B per neuron, 4096 alignment would pad it to 12288).
Active sets for these models come from a recorded trace (mlx_flash.calib.trace).

Routing (MoE presets, `--routing`; the GGUF writer synthetic_gguf has the same choice):
  own      the random model's own routing. A deep random residual stream converges to one direction, so every
           token picks nearly the same experts: sticky, expert caches hit almost always.
  uniform  every block's output projection (attention's, the experts' down) scaled by QUIET and the token
           embeddings of unit variance, so each hidden state stays close to its token's embedding: random
           tokens route uniformly and independently (consecutive reuse ~ k/E), the worst case for a cache.
  skewed   uniform, plus a Zipf-like popularity per layer: the expert of popularity rank r gets a router logit
           offset of -SKEW * ln(r), carried by a direction every token embedding shares (SHARED of its norm).
           Parameters picked, not fitted: the search for published per-expert frequencies and
           consecutive-token reuse of real models found descriptions (long-tailed, imbalanced expert use;
           Mixtral's routing analysis, Jiang et al. 2024, arXiv:2401.04088, section 5: consecutive tokens
           share experts above chance) but no numbers. With SKEW = 0.5 an LRU cache of a quarter (a half) of a
           layer's experts hits about 61% (83%) of independent random tokens' experts on a 48-layer model of
           128 experts, 8 a token (Qwen3-30B-A3B's routing; uniform: 22% (47%), own: 95%), near the per-layer
           LRU hit rates 49-82% reported for real MoE models (as published for Mixtral and Qwen MoE models);
           consecutive reuse 23% (uniform 6%). mlx_flash.tools.routing measures a model's regime.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import mlx_flash  # noqa: F401

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from .. import __version__
from ..convert.source import copy_tokenizer, load_source_model
from ..default_model import cache_root
from ..engine.experts import PROJECTIONS, REGION
from ..format.directory import DEFAULT_ALIGNMENT, FlashDir, FlashWriter
from ..format.layout import PACKED_UNIT_ALIGNMENT
from ..models import get_model_classes
from ..models.inspect import is_moe
from ..models.tiny import make_tiny_model_dir, save_tiny_tokenizer

PRESETS = {
    # LLaMA-1/2 7B
    "llama-7b": dict(
        model_type="llama",
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
        tie_word_embeddings=False,
    ),
    # Llama 3.2 1B
    "llama-1b": dict(
        model_type="llama",
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        tie_word_embeddings=True,
    ),
    # OPT 6.7B (the paper's ReLU model)
    "opt-6.7b": dict(
        model_type="opt",
        hidden_size=4096,
        ffn_dim=16384,
        num_hidden_layers=32,
        num_attention_heads=32,
        vocab_size=50272,
        word_embed_proj_dim=4096,
        do_layer_norm_before=True,
        activation_function="relu",
        enable_bias=True,
        layer_norm_elementwise_affine=True,
        tie_word_embeddings=True,
    ),
    # Qwen3-30B-A3B (mixture of experts: 128 experts of width 768, 8 per token)
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe",
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
    # a small MoE for quick runs (the same structure, 8 layers of 64 experts of 512)
    "moe-small": dict(
        model_type="qwen3_moe",
        hidden_size=1024,
        intermediate_size=2048,
        moe_intermediate_size=512,
        num_experts=64,
        num_experts_per_tok=8,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        vocab_size=32000,
        tie_word_embeddings=False,
    ),
    # tests only
    "tiny": dict(
        model_type="llama",
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=256,
        tie_word_embeddings=False,
    ),
}
_COMMON = {
    "llama": dict(rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096),
    "qwen3_moe": dict(
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=4096,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
    ),
    "opt": dict(max_position_embeddings=2048),
}
GROUP = 64
ROUTINGS = ("own", "uniform", "skewed")
QUIET = 1 / 16  # uniform, skewed: scale of every block's output projection
SKEW = 0.5  # skewed: router logit offset -SKEW * ln(popularity rank)
SHARED = 0.5  # skewed: the shared direction's part of a token embedding (of the random part's norm)


def tiny_quantized(arch: str, root: Path, bits: int = 4, group_size: int = 32, **overrides) -> Path:
    """A tiny random `arch` model (models.tiny: root/"float", Hugging Face names) quantised by mlx-lm into root/"q4"
    with its tokenizer: an mlx-community-style source. overrides: config entries."""
    from mlx_lm.utils import quantize_model, save_model

    src = make_tiny_model_dir(arch, Path(root) / "float", **overrides)
    model, config = quantize_model(*load_source_model(src, lazy=False), group_size=group_size, bits=bits)
    out = Path(root) / "q4"
    save_model(out, model)
    (out / "config.json").write_text(json.dumps(config))
    copy_tokenizer(src, out)
    return out


def output_scale(routing: str) -> float:
    """Scale of the blocks' output projections (attention's o_proj, the experts' down_proj) for `routing`."""
    if routing not in ROUTINGS:
        raise ValueError(f"unknown routing {routing!r} (choose from {', '.join(ROUTINGS)})")
    return 1.0 if routing == "own" else QUIET


def shared_direction(rng, cols: int) -> np.ndarray:
    u = rng.standard_normal(cols)
    return (u / np.linalg.norm(u)).astype(np.float32)


def skewed_embedding(rng, rows: int, cols: int, u: np.ndarray) -> np.ndarray:
    """Token embeddings float32 [rows, cols]: unit-variance random entries plus SHARED * sqrt(cols) along `u`."""
    return rng.standard_normal((rows, cols), dtype=np.float32) + np.float32(SHARED * np.sqrt(cols)) * u


def skewed_router(rng, experts: int, cols: int, u: np.ndarray) -> np.ndarray:
    """A router float32 [experts, cols]: random rows (logits ~ N(0, 1) for an RMS-normed input) plus, along `u`,
    the offset -SKEW * ln(rank) of each expert's popularity rank (a permutation of its own)."""
    offsets = -SKEW * np.log(rng.permutation(experts) + 1.0)
    along = SHARED * np.sqrt(cols) / np.sqrt(1 + SHARED**2)  # an RMS-normed embedding's component along u
    w = rng.standard_normal((experts, cols), dtype=np.float32) / np.float32(np.sqrt(cols))
    return w + (offsets[:, None] / along).astype(np.float32) * u


def preset_config(name: str) -> dict:
    c = dict(PRESETS[name])
    c.update(_COMMON[c["model_type"]])
    c.update(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return c


def n_units(config: dict) -> int:
    return config.get("intermediate_size") or config["ffn_dim"]


def _quantized(rng, rows: int, cols: int, bits: int, scale: float):
    """Random affine-quantised rows: weight uint32 [rows, cols*bits/32], scales/biases f16 [rows, cols/GROUP]."""
    w = np.frombuffer(rng.bytes(rows * cols * bits // 8), dtype=np.uint32).reshape(rows, cols * bits // 32)
    levels = (1 << bits) - 1
    s = (rng.uniform(0.5, 1.5, size=(rows, cols // GROUP)) * scale / levels).astype(np.float16)
    b = (-s.astype(np.float32) * levels / 2).astype(np.float16)
    return {"weight": mx.array(w), "scales": mx.array(s), "biases": mx.array(b)}


def _float(rng, rows: int, cols: int, scale: float):
    return {"weight": mx.array((rng.standard_normal((rows, cols), dtype=np.float32) * scale).astype(np.float16))}


def _ffn_regions(config, storage, rng):
    d, n = config["hidden_size"], n_units(config)
    s = 1.0 / np.sqrt(d)
    if config["model_type"] == "opt":
        names = (("fc1", 4), ("fc2", 8))
    else:
        names = (("gate", 4), ("up", 4), ("down", 8))
    arrays, info = {}, {}
    for name, b in names:
        q = None if storage == "float16" else {"bits": b, "group_size": GROUP}
        part = _float(rng, n, d, s) if q is None else _quantized(rng, n, d, b, s * np.sqrt(3) * 2)
        arrays.update({f"{name}.{k}": v for k, v in part.items()})
        info[name] = {"quantization": q, "transposed": name in ("down", "fc2"), "region": "neurons"}
    bias = {}
    if config["model_type"] == "opt":
        bias = {
            "fc1.bias": mx.array((rng.standard_normal(n) * 0.02).astype(np.float16)),
            "fc2.bias": mx.array(np.zeros(d, np.float16)),
        }
    return {"neurons": arrays}, bias, info


def _expert_regions(config, rng, routing="own"):
    """One layer's experts as convert writes them: SwitchGLU's stacked 4-bit gate/up/down (zero-mean codes)."""
    d, n, e = config["hidden_size"], config["moe_intermediate_size"], config["num_experts"]
    arrays = {}
    for name, rows, cols in (("gate_proj", n, d), ("up_proj", n, d), ("down_proj", d, n)):
        out = output_scale(routing) if name == "down_proj" else 1.0
        q = _quantized(rng, e * rows, cols, 4, np.sqrt(3) * 2 / np.sqrt(cols) * out)
        arrays.update({f"{name}.{k}": v.reshape(e, rows, -1) for k, v in q.items()})
    return {REGION: arrays}


def _quantized_from(make, rows: int, chunk: int = 8192):
    """`rows` float rows from make(n) affine-quantised to 4 bits (group GROUP), made a chunk at a time."""
    parts = [mx.quantize(mx.array(make(min(chunk, rows - i))), group_size=GROUP, bits=4) for i in range(0, rows, chunk)]
    return {
        k: mx.concatenate([p[j] for p in parts]).astype(mx.float16 if j else mx.uint32)
        for j, k in enumerate(("weight", "scales", "biases"))
    }


def _resident(config, storage, rng, routing="own"):
    """Random resident weights with the architecture's names (the model is built lazily: no big allocation);
    `routing` (MoE): see the module's docstring."""

    model_class, args_class = get_model_classes(config)
    model = model_class(args_class.from_dict(config))
    paths = []
    names = {id(m): name for name, m in model.named_modules()}
    for layer in model.layers:
        if is_moe(config):  # the router stays resident
            paths.append(names[id(layer.mlp.switch_mlp)])
            layer.mlp.switch_mlp = nn.Module()
        else:
            paths.append(names[id(layer.mlp)])
            layer.mlp = nn.Module()
    out = {}
    u = shared_direction(rng, config["hidden_size"]) if routing == "skewed" else None
    for name, p in tree_flatten(model.parameters()):
        prefix = name[: -len(".weight")]
        if u is not None and name.endswith("embed_tokens.weight"):
            out.update(
                {
                    f"{prefix}.{k}": v
                    for k, v in _quantized_from(lambda n: skewed_embedding(rng, n, p.shape[1], u), p.shape[0]).items()
                }
            )
        elif u is not None and name.endswith("mlp.gate.weight"):  # the router, float
            out[name] = mx.array(skewed_router(rng, *p.shape, u).astype(np.float16))
        elif p.ndim == 2 and storage != "float16" and p.shape[-1] % GROUP == 0:
            scale = 2.0 / np.sqrt(p.shape[1]) * np.sqrt(3)
            if name.endswith("o_proj.weight"):
                scale *= output_scale(routing)
            elif name.endswith("embed_tokens.weight") and routing != "own":
                scale *= np.sqrt(p.shape[1])  # entries of unit variance: the blocks' outputs are small beside them
            q = _quantized(rng, p.shape[0], p.shape[1], 4, scale)
            out.update({f"{prefix}.{k}": v for k, v in q.items()})
        elif p.ndim == 2:
            out[name] = _float(rng, p.shape[0], p.shape[1], 1.0 / np.sqrt(p.shape[1]))["weight"]
        elif name.endswith("bias"):
            out[name] = mx.zeros(p.shape, mx.float16)
        else:  # norms
            out[name] = mx.ones(p.shape, mx.float16)
    del model
    return out, paths


def build(
    name: str, out=None, storage: str = "q4", seed: int = 0, progress: bool = True, routing: str = "own", **overrides
) -> Path:
    """Build the synthetic flash directory of preset `name` (if missing; config `overrides`, e.g. num_experts=16)
    with MoE `routing` (own, uniform, skewed: the module's docstring) and return its path."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r} (choose from {', '.join(PRESETS)})")
    if storage not in ("q4", "float16"):
        raise ValueError("storage must be q4 or float16")
    output_scale(routing)
    suffix = ("" if storage == "q4" else f"-{storage}") + ("" if routing == "own" else f"-{routing}")
    out = Path(out) if out is not None else cache_root() / "synthetic" / f"{name}{suffix}"
    if (out / "flash.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    config = preset_config(name)
    config.update(overrides)
    if routing != "own" and not is_moe(config):
        raise ValueError("a routing choice is for MoE presets")
    if storage == "q4":
        config["quantization"] = {"group_size": GROUP, "bits": 4}
    rng = np.random.default_rng(seed)
    layers = config["num_hidden_layers"]
    moe = is_moe(config)
    if moe and storage != "q4":
        raise ValueError("MoE presets are 4-bit only")
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as work:
        writer = (
            FlashWriter(Path(work) / "flash", alignment=DEFAULT_ALIGNMENT, unit_alignment=DEFAULT_ALIGNMENT)
            if moe
            # as convert_moe
            else FlashWriter(Path(work) / "flash", alignment=512, unit_alignment=PACKED_UNIT_ALIGNMENT)
        )  # as convert
        resident, paths = _resident(config, storage, rng, routing)
        info = None
        for i in range(layers):
            regions, bias, info = (
                (_expert_regions(config, rng, routing), {}, None) if moe else _ffn_regions(config, storage, rng)
            )
            writer.add_layer(regions)
            resident.update({f"{paths[i]}.{k}": v for k, v in bias.items()})
            del regions
            if progress:
                print(f"\r[synthetic {name}] layer {i + 1}/{layers}", end="", file=sys.stderr, flush=True)
        if progress:
            print(file=sys.stderr)
        opt = config["model_type"] == "opt"
        if moe:
            q = {"bits": 4, "group_size": GROUP}
            info = {
                "kind": "moe",
                "hidden_size": config["hidden_size"],
                "n_experts": config["num_experts"],
                "switch_paths": {str(i): p for i, p in enumerate(paths)},
                "quantization": {m: q for m in PROJECTIONS},
            }
        manifest = {
            "architecture": config["model_type"],
            "dtype": "float16",
            "quantization": None if storage == "float16" else {"bits": 4, "group_size": GROUP},
            "ffn": info
            if moe
            else {
                "kind": "relu" if opt else "glu",
                "activation": "relu" if opt else "silu",
                "layout": "neurons",
                "hidden_size": config["hidden_size"],
                "intermediate_size": n_units(config),
                "matrices": info,
                "mlp_paths": paths,
            },
            "neuron_order": None,
            "source": {
                "model": f"synthetic:{name}",
                "storage": storage,
                "seed": seed,
                **({"routing": routing} if moe else {}),
                "created_by": f"mlx_flash {__version__}",
            },
        }
        writer.finish(config, resident, manifest)

        save_tiny_tokenizer(writer.path, 256)
        if out.exists():
            shutil.rmtree(out)
        os.replace(writer.path, out)
    FlashDir(out)  # opens: manifest, sizes, alignment
    return out


def main():
    p = argparse.ArgumentParser(description="Build a synthetic flash directory (exact shapes, random weights).")
    p.add_argument("--preset", required=True, choices=list(PRESETS))
    p.add_argument("--storage", default="q4", choices=["q4", "float16"])
    p.add_argument("--out", default=None)
    p.add_argument("--routing", default="own", choices=ROUTINGS, help="MoE presets: own (sticky), uniform, skewed.")
    a = p.parse_args()
    path = build(a.preset, a.out, a.storage, routing=a.routing)
    fd = FlashDir(path)
    print(
        f"{path}: resident {fd.resident_bytes / 2**30:.2f} GiB, ffn.bin {fd.ffn_bytes / 2**30:.2f} GiB, "
        f"{len(fd.layers)} layers x "
        + " + ".join(f"{r.n_units} {name} x {r.stride} B" for name, r in fd.layers[-1].items())
    )


if __name__ == "__main__":
    main()
