"""Write a flash directory back as a stock mlx-lm model directory.

    python -m mlx_flash.convert.export DIR --out MLXDIR [--down-bits 8|float]

So mlx-lm (and anything else that reads mlx-lm directories) runs exactly the weights mlx_flash
streams: the peers benchmark compares systems on the same weights.

Written: config.json (with mlx-lm's quantization block), model*.safetensors under mlx-lm's names,
the tokenizer files. The resident weights are copied as they are, but matrices kept as GGML blocks (resident.blocks:
MLX affine codes where those hold them exactly, else float32). The FFN units in ffn.bin are
unpacked back into gate_proj / up_proj / down_proj (fc1 / fc2) matrices:
  * rows stored in mlx-lm's orientation and quantisation (gate/up of the "neurons" layout) are
    copied bit for bit;
  * down (fc2) is stored per neuron, quantised along d_model, but mlx-lm quantises along the
    neurons, so it is dequantised, transposed, and either re-quantised in mlx-lm's layout at
    --down-bits (default 8, with the model's group size: the same bytes as on flash) or kept in
    float16 (--down-bits float: the stored values up to float16 rounding, but twice the bytes).
    8 bits re-quantise already 8-bit values. On SmolLM2 (mlx-lm on the export vs mlx_flash's
    load_resident, one prompt) the logits differ by at most 0.25 at 8 bits, 0.10 in float16 (mostly
    the two float16 compute paths), and 20 greedy tokens are the same with both.
Written a tensor at a time in shards (memory: about one layer), so a 7B model exports in little memory.
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

import mlx_flash  # noqa: F401  (before mlx.core: loads OpenBLAS on Linux)

import mlx.core as mx
from tqdm import tqdm

from ..errors import FlashError
from ..format import ggml
from ..format.directory import FlashDir
from ..format.quant import symmetric_biases
from ..format.safetensors_io import ShardWriter
from ..models.architectures import adapter_for, transpose_codes
from ..models.blocked import UNITS
from .source import TOKENIZER_FILES

SHARD_BYTES = 1 << 30


def _dense(arrays: dict, name: str, info: dict) -> mx.array:
    """The stored rows of matrix `name`, dequantised (float16 scales: float16 values)."""
    w, q = arrays[f"{name}.weight"], info["quantization"]
    if q is None:
        return w
    return mx.dequantize(w, arrays[f"{name}.scales"], arrays[f"{name}.biases"], q["group_size"], q["bits"])


def ffn_matrices(fd: FlashDir, layer: int, down_bits) -> dict:
    """One layer's FFN as mlx-lm linear parameters: {canonical name: {"weight", "scales", "biases"}}.

    Row matrices already in mlx-lm's layout are copied; the others (down/fc2, and gate/up of the
    dip layout) are re-laid out as [out, in] and stored at `down_bits` (int) or in float16 ("float")."""
    arrays = fd.unpack_layer(layer)
    col = adapter_for(fd.config).col_matrix
    out = {}
    for name, info in fd.ffn["matrices"].items():
        if not info["transposed"]:  # [n, d] rows: gate/up in mlx-lm's own layout and quantisation
            out[name] = {k: arrays[f"{name}.{k}"] for k in ("weight", "scales", "biases") if f"{name}.{k}" in arrays}
            continue
        q = info["quantization"] or fd.manifest.get("quantization")
        if q.get("resident_scales"):  # the source's codes and group scales: its exact [out, in] layout again
            scales, biases = fd.group_tables(layer, name)
            biases = symmetric_biases(scales, q["bits"]) if biases is None else biases
            out[name] = {
                "weight": transpose_codes(arrays[f"{name}.weight"], q["bits"]),
                "scales": scales.T,
                "biases": biases.T,
            }
            continue
        w = _dense(arrays, name, info).T  # stored [in, out] -> mlx-lm's [out, in]
        bits = down_bits if name == col else (q or {}).get("bits")
        if bits in (None, "float") or q is None:
            out[name] = {"weight": w.astype(mx.float16)}
        else:
            wq, s, b = mx.quantize(w, q["group_size"], int(bits))
            out[name] = {"weight": wq, "scales": s, "biases": b}
    mx.eval(out)
    return out


def export(path, out, down_bits="8", progress: bool = True) -> Path:
    """Write flash directory `path` as an mlx-lm model directory `out`; returns `out`."""
    fd = FlashDir(path)
    out = Path(out)
    if (out / "config.json").exists():
        raise FlashError(f"{out} already holds a model; remove it or choose another --out")
    if fd.ffn.get("kind") == "moe":
        return _export_moe(fd, out, progress)
    adapter = adapter_for(fd.config)
    out.mkdir(parents=True, exist_ok=True)
    module = dict(zip(adapter.matrices, adapter.names))  # canonical -> the architecture's module name
    config = dict(fd.config)
    quant = dict(config.get("quantization") or {})
    writer = ShardWriter(out, SHARD_BYTES, room=256 << 10)

    resident = _resident(fd, quant)
    for k in sorted(resident):
        v = resident.pop(k)  # read when written, then freed
        # FFN biases are resident under canonical names (<mlp path>.fc1.bias): rename them
        prefix, _, leaf = k.rpartition(".")
        mlp, _, canon = prefix.rpartition(".")
        if mlp in fd.ffn["mlp_paths"] and canon in module:
            if leaf != "bias":  # group scales of source codes (--down-bits source): ffn_matrices writes them
                continue
            writer.add(f"{mlp}.{module[canon]}.{leaf}", v)
        else:
            writer.add(k, v)

    for i, mlp in enumerate(tqdm(fd.ffn["mlp_paths"], desc="export", unit="layer", disable=not progress)):
        mats = ffn_matrices(fd, i, down_bits)
        if adapter.fused_gate_up:  # phi3: gate_up_proj = [gate; up]
            mats = {
                "gate_up": {k: mx.concatenate([mats["gate"][k], mats["up"][k]]) for k in mats["gate"]},
                adapter.col_matrix: mats[adapter.col_matrix],
            }
            names = {"gate_up": adapter.names[0], adapter.col_matrix: adapter.names[1]}
        else:
            names = module
        for canon, params in mats.items():
            hf = f"{mlp}.{names[canon]}"
            for k, v in params.items():
                writer.add(f"{hf}.{k}", v)
            if "scales" in params and quant:
                bits = params["weight"].shape[-1] * 32 // params["scales"].shape[-1] // int(quant["group_size"])
                if bits != quant["bits"]:  # e.g. 8-bit down in a 4-bit model: say so, as mlx-lm's own exports do
                    quant[hf] = {"group_size": quant["group_size"], "bits": bits}
    writer.close()
    return _finish(fd, out, config, quant)


def _export_moe(fd: FlashDir, out: Path, progress: bool) -> Path:
    """An MoE directory: the resident weights and each layer's experts stacked back into its SwitchGLU."""
    out.mkdir(parents=True, exist_ok=True)
    config, quant = dict(fd.config), dict(fd.config.get("quantization") or {})
    writer = ShardWriter(out, SHARD_BYTES, room=256 << 10)
    resident = _resident(fd, quant)
    names = set(resident)
    for k in sorted(names):
        v = resident.pop(k)  # read when written, then freed
        writer.add(k, v)
        if quant and k.endswith(".weight") and v.ndim == 2 and f"{k[: -len('.weight')]}.scales" not in names:
            # a Linear the source left unquantized (the routers): said per module, as mlx-lm's mixed configs do,
            # for runtimes that otherwise quantize every Linear of a quantized model
            quant[k[: -len(".weight")]] = False
    for i, path in tqdm(
        sorted((int(i), p) for i, p in fd.ffn["switch_paths"].items()),
        desc="export",
        unit="layer",
        disable=not progress,
    ):
        arrays = fd.unpack_layer(i)
        if UNITS in config:  # a dense FFN's blocks of neurons: its matrices whole again
            path = path.rsplit(".", 1)[0]
            arrays = {k: _unblocked(k, v) for k, v in arrays.items()}
            for k, v in arrays.items():
                if k.endswith(".scales"):  # (each matrix's own: the types of a file's layers differ)
                    bits = arrays[k.replace(".scales", ".weight")].shape[-1] // v.shape[-1]
                    quant[f"{path}.{k.split('.')[0]}"] = {"group_size": 32, "bits": bits}
        for k, v in arrays.items():
            writer.add(f"{path}.{k}", v)
    writer.close()
    config.pop(UNITS, None)
    return _finish(fd, out, config, quant)


def _unblocked(name: str, v: mx.array) -> mx.array:
    """Component `name` of a dense FFN's blocks of neurons (models/blocked.py) stacked [blocks, out, in] as its
    whole matrix: gate and up rows one block after the other, down rows each block's columns side by side."""
    if name.startswith("down_proj."):
        return v.swapaxes(0, 1).reshape(v.shape[1], -1)
    return v.reshape(-1, v.shape[-1])


def _resident(fd: FlashDir, quant: dict) -> dict:
    """The resident weights as mlx-lm's modules hold them: matrices kept as GGML blocks (resident.blocks) as the same
    values, MLX affine codes where they are that exactly (Q4_0, Q8_0, Q4_K: ggml.to_affine), else float32
    (`quant` says which, per module)."""
    resident = fd.load_resident()
    for path, kind in fd.blocks.items():
        raw = resident.pop(f"{path}.weight")
        if kind in ggml.AFFINE:
            *codes, bits = ggml.to_affine(raw, kind)
            arrays, quant[path] = dict(zip(("weight", "scales", "biases"), codes)), {"group_size": 32, "bits": bits}
        else:
            arrays, quant[path] = {"weight": ggml.dequantize(raw, kind)}, False
        resident.update({f"{path}.{k}": v for k, v in arrays.items()})
    return resident


def _finish(fd: FlashDir, out: Path, config: dict, quant: dict) -> Path:
    listed = [q for q in quant.values() if isinstance(q, dict)]
    if listed and "bits" not in quant:  # (mlx-lm reads a default even where each quantised module has its own)
        quant = {**listed[0], **quant}
    if listed or "bits" in quant:
        config["quantization"] = quant
        config["quantization_config"] = dict(quant)
    with open(out / "config.json", "w") as f:
        json.dump(config, f, indent=2)
    for pattern in TOKENIZER_FILES:
        for src in fd.path.glob(pattern):
            if src.is_file():
                shutil.copy2(src, out / src.name)
    return out


def setup_arg_parser():
    p = argparse.ArgumentParser(description="Write a flash directory as a stock mlx-lm model directory.")
    p.add_argument("model", help="Flash directory.")
    p.add_argument("--out", "--mlx-path", dest="out", required=True, help="Output mlx-lm model directory.")
    p.add_argument(
        "--down-bits",
        choices=["4", "8", "float"],
        default="8",
        help="down_proj (fc2) re-laid out along the neurons: re-quantised at this many bits "
        "(default 8: the same bytes as on flash) or float16.",
    )
    return p


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    try:
        out = export(args.model, args.out, args.down_bits)
    except FlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    size = sum(f.stat().st_size for f in out.glob("model*.safetensors"))
    print(f"wrote {out}: {size / 2**20:.1f} MiB of weights")
    return 0


if __name__ == "__main__":
    sys.exit(main())
