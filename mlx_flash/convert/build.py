"""Convert a model into a flash directory.

    python -m mlx_flash.convert --model SRC --out DIR [--dtype float16] [--bits 4] [--group-size 64]
        [--prune wanda --prune-sparsity 0.5 [--prune-text PATH] [--prune-format bitmap|dense]]

SRC is a local mlx-lm / Hugging Face directory, a hub id, or a GGUF file (a SRC that does not exist is a hub id
if it reads org/name, not ending in .gguf or .safetensors: ./models/smol is a path). With neither --dtype
nor --bits, a float source (F32/F16/BF16 GGUF, float HF directory) is quantised to 8-bit, group
--group-size (float32 runs about 2x slower than 8-bit on the CPU; 8-bit is as good as lossless),
and a quantised one keeps its quantisation. --dtype alone keeps floats, cast to that dtype.

Memory does not grow with the model: a GGUF is read a tensor at a time from its memory map into an
mlx-lm directory (in the output's temporary directory, a shard per layer freed as the output is written, a dense
FFN converted a layer at a time: the disk holds about the output's size, which convert checks is free before it
writes: disk.py), every directory is loaded lazily, each layer's FFN is evaluated, written and freed in turn, and
the resident weights are written one array at a time (format.directory.FlashWriter.finish). A 7B is converted
under a 1 GiB cap. --prune is the exception:
calibration runs the whole model, in float32.

--prune wanda prunes every FFN matrix with Wanda (prune.py; input norms from the first half
of WikiText-2 test or --prune-text): gate/up (fc1) per output row, down (fc2) per neuron, so
every stored row keeps exactly d - floor(sparsity * d) weights. With --prune-format bitmap
(the default) each pruned matrix is stored as ENDOR bitmap rows (bitmap.py, format v2): float
rows as their non-zero values; 8-bit rows as the codes that differ from their group's code of
0.0 (scales/biases stay dense; the runtime refills the rest). 4-bit codes are packed two per
byte and cannot be bitmap-encoded: --prune-format auto (the default) stores those matrices
pruned but dense and says so (a 4-bit model's 8-bit down rows are still encoded); --prune-format
bitmap refuses them before calibrating (use --bits 8, float rows, e.g. --dequantize for a 4-bit
source, or --prune-format dense).
"""

import argparse
import json
import os
import re
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map
from tqdm import tqdm

from .. import __version__
from ..compute.blocks import block_kinds, is_blocks
from ..errors import FlashError
from ..format.bitmap import capacity_for_sparsity
from ..format.directory import DEFAULT_ALIGNMENT, FlashDir, FlashWriter
from ..format.layout import PACKED_UNIT_ALIGNMENT, BundleLayout, Encoding, dtype_name
from ..format.safetensors_io import TensorSpool
from ..models.architectures import adapter_for, symmetric
from ..models.blocked import UNITS
from ..models.inspect import is_moe
from ..texts import wikitext
from .disk import SourceWeights, check_free_space, disk_full_error
from .gguf import IN_PLACE, FFNHoles
from .moe import convert_moe
from .prune import stored_row_pruner, text_input_norms
from .source import Unlinked, copy_tokenizer, load_source_model, local_source, mlp_paths, release, resolve_source

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
# What the CLI makes of a float source given neither --dtype nor --bits: float32 runs about 2x slower than
# 8-bit on the CPU and takes 4x the flash reads; 8-bit (group 64) is as good as lossless.
DEFAULT_FLOAT_BITS = 8
PRUNE_METHODS = ("wanda",)
PRUNE_FORMATS = ("auto", "bitmap", "dense")


def _model_quantization(model: nn.Module) -> Optional[dict]:
    """{"bits", "group_size"} of the model's FFN (from its first mlp), or None if float."""
    for _, m in model.layers[0].mlp.named_modules():
        if isinstance(m, nn.QuantizedLinear):
            return {"bits": m.bits, "group_size": m.group_size}
    return None


def _float_dtype(model: nn.Module) -> mx.Dtype:
    for _, p in tree_flatten(model.parameters()):
        if mx.issubdtype(p.dtype, mx.floating):
            return p.dtype
    return mx.float32


def convert(
    model: str,
    out: str,
    dtype: Optional[str] = None,
    bits=None,
    group_size: int = 64,
    dequantize: bool = False,
    down_bits=None,
    alignment: Optional[int] = None,
    layout: str = "neurons",
    unit_alignment: Optional[int] = PACKED_UNIT_ALIGNMENT,
    progress: bool = True,
    prune: Optional[str] = None,
    prune_sparsity: float = 0.5,
    prune_text=None,
    prune_format: str = "auto",
    prune_seqs: int = 16,
    prune_seq_len: int = 256,
    copy: bool = False,
) -> Path:
    """Convert `model` into the flash directory `out`; returns its path.

    The output is written under a temporary name and renamed at the end, so an
    interrupted conversion never leaves a directory that loads. DiskSpaceError before anything is written if the
    output's filesystem has not the space it needs at its peak (disk.py), or if it fills up mid-way.
    prune: None or "wanda" (see the module docstring), calibrated on prune_seqs x prune_seq_len
    tokens of the first half of prune_text (default WikiText-2 test).
    bits: None keeps the source's quantisation (or floats), 4/8 quantise, "auto" (the CLI's default)
    quantises a float source to DEFAULT_FLOAT_BITS and keeps a quantised one, saying which.
    copy: a mixture-of-experts model's experts are written into the output even where they could be read in place
    from the source directory's files (moe.py).
    """
    out = Path(out).expanduser().resolve()
    if out.exists():
        raise FlashError(f"{out} already exists; remove it or choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    if bits not in (None, "auto", 4, 8):
        raise ValueError(f"--bits must be 4 or 8, got {bits}")
    if prune is not None:
        _check_prune(prune, prune_sparsity, prune_format, layout)

    with disk_full_error(out), _work_dir(out) as work:  # (the work directory is removed first)
        work = Path(work)
        source = local_source(model)
        needed = _disk_needed(source, dtype, bits, group_size, dequantize, down_bits, layout, prune, not copy)
        check_free_space(out, needed)
        src_dir = resolve_source(source, work, progress, experts_in_place=True, ffn_holes=prune is None)
        model_obj, config = load_source_model(src_dir)
        holes = FFNHoles.open(src_dir)
        evaluate = None
        gguf = Path(src_dir).resolve().is_relative_to(work.resolve())  # (made from a GGUF)
        if gguf:  # each of its shards freed once read
            evaluate = Unlinked(src_dir, holes.files if holes is not None else ()).evaluate
        if holes is not None:  # (layer 0's FFN is looked at before the layers are written)
            holes.fill(mlp_paths(model_obj)[0])
        if is_moe(config):
            asked = {
                "--dtype": dtype,
                "--bits": bits if bits != "auto" else None,
                "--dequantize": dequantize or None,
                "--down-bits": down_bits,
                "--prune": prune,
                "--layout": None if layout == "neurons" else layout,
            }
            asked = [k for k, v in asked.items() if v is not None]
            if asked:
                raise FlashError(
                    f"{' '.join(asked)}: a mixture-of-experts model converts its experts as the source "
                    "stores them; these options apply to dense models only"
                )
            kept = Path(src_dir) / IN_PLACE  # (a GGUF's experts left in it as their blocks: copied as they are)
            ggml = json.loads(kept.read_text()) if kept.is_file() else None
            # (a dense FFN's blocks of neurons are copied: its down rows' blocks are not stacked in the file)
            in_place = not copy and (ggml is not None or not gguf) and UNITS not in config
            return convert_moe(
                model_obj, config, src_dir, work, out, model, alignment, progress, in_place, ggml, evaluate
            )
        adapter = adapter_for(config)
        norms = None
        if prune is not None and prune_format == "bitmap":
            stored = _stored_quantization(bits, group_size, dequantize, _model_quantization(model_obj))
            if stored is not None and stored["bits"] == 4:
                raise FlashError(BITMAP_4BIT)  # before calibrating, not minutes later
        if prune is not None:  # on the source weights, before any cast or re-quantisation
            norms, calibration = _calibrate(model_obj, src_dir, config, prune_text, prune_seqs, prune_seq_len, progress)

        if dtype is not None:
            model_obj.set_dtype(DTYPES[dtype])  # float parameters only
        source_quant = _model_quantization(model_obj)
        quant = _stored_quantization(bits, group_size, dequantize, source_quant)
        if bits == "auto" and source_quant is None and quant is not None:
            print(
                f"float source ({dtype_name(_float_dtype(model_obj))}): quantising to {quant['bits']}-bit, group "
                f"size {group_size} (the default; pass --dtype to keep floats)"
            )
        if source_quant is not None and quant != source_quant:
            from mlx_lm.utils import dequantize_model

            model_obj = dequantize_model(model_obj)
            config.pop("quantization", None)
            config.pop("quantization_config", None)
        if quant is not None and _model_quantization(model_obj) is None:
            _quantize_resident(model_obj, quant["bits"], group_size)
            config["quantization"] = {"group_size": group_size, "bits": quant["bits"]}
        # down's own quantisation where the source's differs from the model's (a GGUF's Q6_K down re-quantised to
        # 8 bits beside Q5_0 gate and up)
        col = adapter.linears(model_obj.layers[0].mlp)[adapter.col_matrix]
        col_quant = quant if quant is None or not hasattr(col, "bits") else {**quant, "bits": col.bits}
        if down_bits is None:
            down_bits = _default_down_bits(col_quant, layout, prune)
        ffn_quant = {m: quant for m in adapter.matrices}
        ffn_quant[adapter.col_matrix] = _down_quantization(col_quant, down_bits)
        if down_bits == "source":
            if quant is None or col_quant["bits"] not in (2, 4, 8) or layout != "neurons" or prune is not None:
                raise FlashError(
                    "--down-bits source keeps a 2/4/8-bit quantised model's down codes per neuron (groups' "
                    f"scales resident); it needs the neurons layout without --prune (got quantisation {col_quant}, "
                    f"layout {layout!r}, prune {prune!r})"
                )
            ffn_quant[adapter.col_matrix] = {**col_quant, "resident_scales": True}
            first = adapter.linears(model_obj.layers[0].mlp)
            if all(symmetric(first[m]) for m in adapter.matrices):  # Q4_0 / Q8_0: the biases follow from the scales
                ffn_quant = {m: {**q, "symmetric": True} for m, q in ffn_quant.items()}
            del first

        writer, encodings = None, None
        paths = mlp_paths(model_obj)
        resident_ffn, matrices = {}, None
        sizes = [sum(v.nbytes for _, v in tree_flatten(layer.mlp.parameters())) for layer in model_obj.layers]
        bar = tqdm(
            total=sum(sizes), desc="FFN layers", unit="B", unit_scale=True, unit_divisor=1024, disable=not progress
        )
        for i, layer in enumerate(model_obj.layers):
            if holes is not None:
                holes.fill(paths[i])
            pruner = None if norms is None else stored_row_pruner(norms[i], prune_sparsity, adapter.col_matrix)
            regions, biases, matrices = adapter.split(layer.mlp, ffn_quant, layout, prune=pruner)
            mx.eval(regions, biases)
            if writer is None:
                if prune is not None and prune_format != "dense":
                    encodings = bitmap_encodings(
                        regions["neurons"], adapter.matrices, ffn_quant, prune_sparsity, strict=prune_format == "bitmap"
                    )
                writer = FlashWriter(
                    work / "flash", alignment or auto_alignment(regions, encodings), encodings, unit_alignment
                )
            writer.add_layer(regions)
            resident_ffn.update(_spooled(biases, work / f"ffn-resident-{i}.safetensors", paths[i]))
            layer.mlp = nn.Module()  # drop the FFN so the resident set below excludes it
            bar.update(sizes[i])
            bar.set_postfix_str(f"layer {i + 1}/{len(sizes)}")
        bar.close()
        del regions, biases, layer
        resident = dict(tree_flatten(model_obj.parameters()))
        resident.update(resident_ffn)
        resident_ffn.clear()

        n_neurons = writer.layers[0]["neurons"].n_units
        manifest = {
            "architecture": config["model_type"],
            "dtype": dtype_name(_float_dtype(model_obj)),
            "quantization": quant,
            "ffn": {
                "kind": adapter.kind,
                "activation": adapter.activation,
                "layout": layout,
                "hidden_size": config["hidden_size"],
                "intermediate_size": n_neurons,
                "matrices": matrices,
                "mlp_paths": paths,
            },
            "neuron_order": None,
            "pruning": None
            if prune is None
            else {
                "method": prune,
                "sparsity": prune_sparsity,
                "format": prune_format,
                "gate_up": "per output row",
                "down": "per neuron (per='input')",
                "calibration": calibration,
            },
            "source": {"model": str(model), "created_by": f"mlx_flash {__version__}"},
        }
        kept = block_kinds(model_obj)
        release(model_obj)  # `resident` holds the only references: each array is freed once written
        writer.finish(config, resident, manifest, progress, evaluate, kept)
        copy_tokenizer(src_dir, writer.path)
        os.replace(writer.path, out)
    return out


def _work_dir(out: Path) -> tempfile.TemporaryDirectory:
    """The temporary directory beside `out`, `.NAME.PID.xxxxxxxx`, once those of earlier conversions to `out` whose
    process is gone are removed (SIGKILL leaves them; exceptions, Ctrl-C and SIGTERM remove their own). A pid rather
    than a lock: nothing to release, and a pid reused meanwhile only puts the removal off to a later run."""
    for p in out.parent.iterdir():
        m = re.fullmatch(rf"\.{re.escape(out.name)}\.(\d+)\.\w+", p.name)
        if m and p.is_dir() and not _alive(int(m.group(1))):
            shutil.rmtree(p, ignore_errors=True)
    return tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.{os.getpid()}.")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's process; not a pid at all (left alone)
        pass
    return True


def _disk_needed(source: Path, dtype, bits, group_size, dequantize, down_bits, layout, prune, in_place=True) -> int:
    """What converting `source` writes at its peak (disk.py), the model stored as `convert` will store it."""
    weights = SourceWeights(source)
    if weights.moe:  # the experts are stored as the source stores them, or read in place (moe.py)
        return weights.peak_bytes(weights.quant, weights.quant, False, None, in_place and weights.stacked)
    quant = _stored_quantization(bits, group_size, dequantize, weights.quant)
    down_bits = down_bits or _default_down_bits(quant, layout, prune, say=lambda _: None)
    float_size = DTYPES[dtype].size if dtype is not None else None
    down = _down_quantization(quant, down_bits)
    return weights.peak_bytes(quant, down, down_bits == "source", float_size, holes=prune is None)


def _spooled(arrays: dict, path: Path, prefix: str) -> dict:
    """`arrays` saved to `path` and loaded back lazily (read when written out, not held until then), as
    {prefix.name: array} in their order."""
    if not arrays:
        return {}
    # (not mx.save_safetensors: its write errors carry no errno, so a full disk would not read as one)
    spool = TensorSpool(path.with_name(path.name + ".spool"))
    for k, v in arrays.items():
        spool.add(k, v)
    spool.save(path)
    loaded = mx.load(str(path))
    path.unlink()  # (read through the descriptor MLX holds until then: freed as soon as written out)
    return {f"{prefix}.{k}": loaded[k] for k in arrays}


def _default_down_bits(quant: Optional[dict], layout: str, prune: Optional[str], say=print):
    """How down/fc2 rows are stored when --down-bits is not given, said on stdout (`say`): a 2/4/8-bit source keeps
    its own codes per neuron (the weights are the source's, and no unit is larger than the source's bytes); where that
    layout does not apply (dip layout, pruning) or the codes are of other widths (5-bit Q5_0/Q5_K), 8 bits
    (re-quantised to 4 bits along d_model, SmolLM2 lost 4.9% perplexity; 8 bits nothing measurable), else the
    model's bits."""
    if quant is None:
        return None
    if quant["bits"] in (2, 4, 8) and layout == "neurons" and prune is None:
        say(
            f"down rows: the model's {quant['bits']}-bit codes per neuron, their group scales resident (the model's "
            "weights and bytes; --down-bits 8 re-quantises them along d_model instead)"
        )
        return "source"
    if quant["bits"] != 8:
        say(
            "down rows: re-quantised to 8 bits along d_model (the source's codes need 2, 4 or 8 bits, the neurons "
            "layout and no pruning; 4 bits would cost 4.9% perplexity on SmolLM2)"
        )
        return 8
    return None


def _down_quantization(quant: Optional[dict], down_bits) -> Optional[dict]:
    """How down/fc2 rows are quantised (None: floats) in a model quantised as `quant`, given --down-bits."""
    if down_bits == "float":
        return None
    if down_bits in (None, "source") or quant is None:
        return quant
    return {"bits": int(down_bits), "group_size": quant["group_size"]}


def auto_alignment(regions, encodings=None) -> int:
    """4096 (flash pages) unless a unit on flash is smaller: then 512, O_DIRECT's minimum on Linux, so
    small bundles are not padded 2-8x on flash and in the caches (SmolLM2: 1368 B bundles)."""
    smallest = min(
        BundleLayout.from_arrays(a, 1, {k: e for k, e in (encodings or {}).items() if k in a}).disk_nbytes
        for a in regions.values()
    )
    return DEFAULT_ALIGNMENT if smallest >= DEFAULT_ALIGNMENT else 512


def _check_prune(prune, sparsity, fmt, layout):
    if prune not in PRUNE_METHODS:
        raise FlashError(f"--prune must be one of {', '.join(PRUNE_METHODS)}, got {prune!r}")
    if not 0.0 < sparsity < 1.0:
        raise FlashError(f"--prune-sparsity must be in (0, 1), got {sparsity}")
    if fmt not in PRUNE_FORMATS:
        raise FlashError(f"--prune-format must be one of {', '.join(PRUNE_FORMATS)}, got {fmt!r}")
    if layout != "neurons":
        raise FlashError(
            "--prune needs --layout neurons (the dip layout stores gate/up by input column: "
            "Wanda's per-output-row counts would not be per unit)"
        )


def _calibrate(model, src_dir, config, text, n_seqs, seq_len, progress):
    """Wanda input norms per layer from calibration text, computed dequantised in float32 (BLAS
    matmuls: MLX's CPU quantised and float16 matmuls are many times slower). The model is
    restored afterwards: quantised modules put back, floats cast back (exact round trip)."""
    from mlx.utils import tree_unflatten
    from mlx_lm.utils import dequantize_model, load_tokenizer

    quantized = [(k, m) for k, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]
    dtypes = tree_map(lambda p: p.dtype, model.parameters())
    dequantize_model(model)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())  # once, not per forward
    seq_len = min(seq_len, config.get("max_position_embeddings") or seq_len)
    try:
        norms = text_input_norms(model, load_tokenizer(src_dir), text, n_seqs, seq_len, progress)
    except (OSError, ValueError) as e:
        raise FlashError(f"--prune-text {text or wikitext()}: {e}") from e
    finally:
        if quantized:
            model.update_modules(tree_unflatten(quantized))
        model.update(tree_map(lambda p, d: p.astype(d), model.parameters(), dtypes))
    info = {
        "text": str(text) if text else "wikitext-2 test (bundled)",
        "half": "first",
        "seqs": n_seqs,
        "seq_len": seq_len,
    }
    return norms, info


BITMAP_4BIT = (
    "4-bit codes are packed several per byte and cannot be bitmap-encoded; use --bits 8, a float model, "
    "--prune-format dense, or --prune-format auto (4-bit matrices stored dense)"
)


def _stored_quantization(bits, group_size: int, dequantize: bool, source_quant: Optional[dict]) -> Optional[dict]:
    """The quantisation `convert` stores a model with ({"bits", "group_size"}; None: floats): the source's own
    (`source_quant`, None if float) unless --dequantize or other --bits / --group-size re-quantise it. bits "auto"
    (the CLI's default): a quantised source's own, DEFAULT_FLOAT_BITS for a float one."""
    if bits == "auto":
        bits = None if source_quant is not None else DEFAULT_FLOAT_BITS
    if (
        source_quant is not None
        and not dequantize
        and (bits is None or (bits, group_size) == (source_quant["bits"], source_quant["group_size"]))
    ):
        return source_quant
    return None if bits is None else {"bits": bits, "group_size": group_size}


def bitmap_encodings(arrays, matrices, quant, sparsity, strict: bool = True) -> dict:
    """The Encoding of each pruned matrix's stored rows (component "<m>.weight") at `sparsity`.
    4-bit rows cannot be encoded: FlashError if `strict`, else they stay dense (said on stderr)."""
    out = {}
    for m in matrices:
        w, q = arrays[f"{m}.weight"], quant[m]
        if q is None:
            d = w.shape[-1]
            out[f"{m}.weight"] = Encoding("bitmap", dtype_name(w.dtype), d, capacity_for_sparsity(d, sparsity))
        elif q["bits"] == 8:
            d = w.shape[-1] * 4  # uint32 words of four codes
            out[f"{m}.weight"] = Encoding(
                "bitmap", "uint8", d, capacity_for_sparsity(d, sparsity), "affine_zero", q["group_size"]
            )
        elif strict:
            raise FlashError(f"{m}: {BITMAP_4BIT}")
        else:
            print(f"[convert] {m}: 4-bit rows cannot be bitmap-encoded: stored pruned but dense", file=sys.stderr)
    return out


def _quantize_resident(model: nn.Module, bits: int, group_size: int) -> None:
    """Quantise like mlx-lm, except the FFN: adapter.split quantises it per stored row."""

    def predicate(path, m):
        return (
            hasattr(m, "to_quantized")
            and not is_blocks(m)
            and ".mlp." not in f"{path}."
            and m.weight.shape[-1] % group_size == 0
        )

    nn.quantize(model, group_size=group_size, bits=bits, class_predicate=predicate)


def setup_arg_parser():
    parser = argparse.ArgumentParser(description="Convert a model into an mlx_flash flash directory.")
    parser.add_argument(
        "--model",
        required=True,
        help="Local model directory, GGUF file, or Hugging Face repo id. A path that does not exist is a repo id if it "
        "reads org/name (one '/', not starting with '.', not ending in .gguf or .safetensors), else an error: "
        "write ./models/smol for a local models/smol.",
    )
    parser.add_argument("--out", "--mlx-path", dest="out", required=True, help="Output flash directory.")
    parser.add_argument(
        "--dtype", choices=list(DTYPES), default=None, help="Float dtype of the stored weights (default: the source's)."
    )
    parser.add_argument(
        "-q",
        "--bits",
        type=int,
        choices=[4, 8],
        default=None,
        help="Quantise to this many bits (default: a quantised source keeps its quantisation; a float "
        "one becomes 8-bit unless --dtype or --dequantize is given).",
    )
    parser.add_argument(
        "--group-size", "--q-group-size", dest="group_size", type=int, default=64, help="Quantisation group size."
    )
    parser.add_argument("-d", "--dequantize", action="store_true", help="Store a quantised source in float.")
    parser.add_argument(
        "--down-bits",
        choices=["4", "8", "float", "source"],
        default=None,
        help="Quantised models only: how down/fc2 rows are stored per neuron, re-quantised along d_model, "
        "float (exact, larger bundles) or source (exact and smallest: the source's codes per neuron, the "
        "groups' scales and biases resident, 1/8 of the matrix at 4-bit group 32; neurons layout, dense and "
        "selectors that read no down row norms from flash). Default: source for 2/4/8-bit models in the neurons "
        "layout without pruning; else 8 for 4-bit models (4 bits costs +4.9%% perplexity on SmolLM2, see "
        "BENCHMARKS.md), else the model's bits.",
    )
    parser.add_argument(
        "--layout",
        choices=["neurons", "dip"],
        default="neurons",
        help="neurons: one bundle per FFN neuron (all sparsifiers but dip); "
        "dip: gate/up by input column, for --sparsity dip.",
    )
    parser.add_argument(
        "--prune",
        choices=list(PRUNE_METHODS),
        default=None,
        help="Prune the FFN matrices (Wanda: gate/up per output row, down per neuron).",
    )
    parser.add_argument("--prune-sparsity", type=float, default=0.5, help="Fraction of each row pruned (default 0.5).")
    parser.add_argument(
        "--prune-text", default=None, help="Calibration text; its first half is used (default: WikiText-2 test)."
    )
    parser.add_argument("--prune-seqs", type=int, default=16, help="Calibration sequences (default 16).")
    parser.add_argument(
        "--copy",
        action="store_true",
        help="Mixture-of-experts models: write the experts into the output (a self-contained directory; a GGUF's as "
        "its blocks are) instead of reading them in place from the source's files (the default where they are "
        "stacked there, or a GGUF's of block types with kernels).",
    )
    parser.add_argument("--prune-seq-len", type=int, default=256, help="Tokens per calibration sequence (default 256).")
    parser.add_argument(
        "--prune-format",
        choices=list(PRUNE_FORMATS),
        default="auto",
        help="bitmap: store pruned rows ENDOR bitmap-encoded (float or 8-bit rows); dense: as they are; "
        "auto (default): bitmap where the rows allow it, dense for 4-bit ones.",
    )
    parser.add_argument(
        "--alignment",
        type=int,
        default=None,
        help="Alignment of each layer's region in bytes "
        "(power of two >= 512; default 4096, or 512 for bundles under 4 KiB).",
    )
    parser.add_argument(
        "--unit-alignment",
        type=int,
        default=PACKED_UNIT_ALIGNMENT,
        help=f"Bytes between units are a multiple of this (default {PACKED_UNIT_ALIGNMENT}: "
        "units packed, no padding read with them; the --alignment value pads every unit to it, as format v1/v2 did).",
    )
    return parser


def _exit_on_sigterm(signum, frame):
    # unwinds as Ctrl-C does, so that the temporary directory is removed on the way out (exit status 143, as killed)
    raise SystemExit(128 + signum)


def main():
    args = setup_arg_parser().parse_args()
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        bits = args.bits
        if bits is None and args.dtype is None and not args.dequantize:
            bits = "auto"
        out = convert(
            args.model,
            args.out,
            args.dtype,
            bits,
            args.group_size,
            args.dequantize,
            args.down_bits,
            args.alignment,
            args.layout,
            unit_alignment=args.unit_alignment,
            prune=args.prune,
            prune_sparsity=args.prune_sparsity,
            prune_text=args.prune_text,
            prune_format=args.prune_format,
            prune_seqs=args.prune_seqs,
            prune_seq_len=args.prune_seq_len,
            copy=args.copy,
        )
    except FlashError as e:
        raise SystemExit(f"error: {e}")
    except KeyboardInterrupt:  # (the temporary directory is gone by now)
        raise SystemExit("interrupted: nothing was written") from None

    fd = FlashDir(out)
    streamed = [layer for layer in fd.layers if layer]  # (an MoE model's dense layers stay resident)
    units = ", ".join(
        f"{r.n_units} {name} x {r.stride} B ({fd.layouts[name].disk_nbytes} B of data"
        + (f", {fd.layouts[name].nbytes} B expanded" if fd.layouts[name].encoded else "")
        + ")"
        for name, r in streamed[0].items()
    )
    where = f"ffn.bin {fd.ffn_bytes / 2**20:.1f} MiB" if fd.sources is None else f"units in place in {fd.units_where}"
    print(f"wrote {out}: resident {fd.resident_bytes / 2**20:.1f} MiB, {where} ({len(streamed)} layers of {units})")


if __name__ == "__main__":
    main()
