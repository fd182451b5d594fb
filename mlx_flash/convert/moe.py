"""Convert a mixture-of-experts model: each expert of each layer becomes one unit on flash.

The source is whatever mlx-lm loads (a Hugging Face directory with per-expert tensors, which the model's
`sanitize` stacks, or an mlx-community directory with `switch_mlp` stacked): the experts' codes, scales
and biases are written as the source stores them (no re-quantisation, so the weights equal the source's;
symmetric codes such as a GGUF's Q4_0 keep no biases, as the source keeps none);
routers, norms, attention, embeddings and shared experts stay resident.
"""

import os
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from tqdm import tqdm

from .. import __version__
from ..engine.experts import REGION, expert_arrays, expert_quantization, experts_per_token, switch_paths
from ..format.directory import DEFAULT_ALIGNMENT, FlashWriter
from ..format.layout import dtype_name
from ..format.quant import is_symmetric
from .source import copy_tokenizer, release


def convert_moe(
    model: nn.Module,
    config: dict,
    src_dir: Path,
    work: Path,
    out: Path,
    source: str,
    alignment: int = None,
    progress: bool = True,
) -> Path:
    """Write `model`'s experts and resident weights as a flash directory at `out` (built in `work`)."""
    paths = switch_paths(model)
    top_k = experts_per_token(model, paths)
    modules = dict(model.named_modules())
    alignment = alignment or DEFAULT_ALIGNMENT
    writer = FlashWriter(work / "flash", alignment, unit_alignment=alignment)  # an expert read straight into its row
    quant, n_experts, hidden = None, None, None
    try:
        sizes = [
            sum(v.nbytes for _, v in tree_flatten(modules[paths[i]].parameters())) if i in paths else 0
            for i in range(len(model.layers))
        ]
        bar = tqdm(total=sum(sizes), desc="experts", unit="B", unit_scale=True, unit_divisor=1024, disable=not progress)
        for i in range(len(model.layers)):
            bar.set_postfix_str(f"layer {i + 1}/{len(sizes)}")
            if i not in paths:
                writer.add_layer({})
                continue
            switch = modules[paths[i]]
            q = expert_quantization(switch)
            arrays = expert_arrays(switch)
            mx.eval(arrays)
            for (
                name,
                pq,
            ) in q.items():  # Q4_0 / Q8_0: the biases follow from the scales, so (as on the source) not stored
                if (
                    pq is not None
                    and f"{name}.biases" in arrays
                    and is_symmetric(arrays[f"{name}.biases"], arrays[f"{name}.scales"], pq["bits"])
                ):
                    q[name] = {**pq, "symmetric": True}
                    del arrays[f"{name}.biases"]
            if quant is not None and q != quant:
                raise ValueError(f"layer {i}: experts quantised as {q}, earlier layers as {quant}")
            quant = q
            n_experts = next(iter(arrays.values())).shape[0]
            hidden = arrays[f"{list(q)[-1]}.weight"].shape[1]  # the last projection's outputs
            writer.add_layer({REGION: arrays})
            parent, name = paths[i].rsplit(".", 1)
            setattr(modules[parent], name, nn.Module())  # the resident set below excludes the experts
            release(switch)  # (`modules` still refers to its modules) its arrays are on flash: freed now
            bar.update(sizes[i])
        bar.close()
        del switch, arrays
        resident = dict(tree_flatten(model.parameters()))
        floats = [v.dtype for v in resident.values() if mx.issubdtype(v.dtype, mx.floating)]
        manifest = {
            "architecture": config["model_type"],
            "dtype": dtype_name(floats[0] if floats else mx.float32),
            "quantization": config.get("quantization"),
            "ffn": {
                "kind": "moe",
                "hidden_size": hidden,
                "n_experts": n_experts,
                "experts_per_token": top_k,  # the runtime's read-ahead and buffers for one token's experts
                "switch_paths": {str(k): v for k, v in paths.items()},
                "quantization": quant,
            },
            "source": {"model": str(source), "created_by": f"mlx_flash {__version__}"},
        }
        release(model)  # `resident` holds the only references: each array is freed once written
        writer.finish(config, resident, manifest, progress)
    except BaseException:
        writer.abort()
        raise
    copy_tokenizer(src_dir, writer.path)
    os.replace(writer.path, out)
    return out
