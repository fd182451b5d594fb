"""Build a model from a flash directory: resident weights into the architecture, FFNs replaced."""

from typing import Callable, Dict, Tuple

import mlx.core as mx
import mlx.nn as nn

from .architectures import adapter_for
from .errors import FlashFormatError
from .ffn import ResidentFFN
from .flash_format import FlashDir


def build_model(fd: FlashDir, make_ffn: Callable[[int, Dict[str, mx.array]], nn.Module]) -> nn.Module:
    """Instantiate the architecture, load the resident weights, and set layers[i].mlp = make_ffn(i, biases_i)."""
    from mlx_lm.utils import infer_quant_config

    from .models import get_model_classes

    config = fd.config
    adapter_for(config)
    model_class, args_class = get_model_classes(config)
    model = model_class(args_class.from_dict(config))
    weights = fd.load_resident()
    if hasattr(model, "sanitize"):  # idempotent in mlx-lm; some models set ties from the weights present
        weights = model.sanitize(weights)

    paths = fd.ffn["mlp_paths"]
    if len(paths) != len(model.layers) or len(fd.layers) != len(model.layers):
        raise FlashFormatError(
            f"{fd.path}: manifest has {len(fd.layers)} FFN layers, the model config {len(model.layers)}"
        )
    for i, layer in enumerate(model.layers):
        prefix = paths[i] + "."
        bias = {k[len(prefix) :].split(".")[0]: weights.pop(k) for k in list(weights) if k.startswith(prefix)}
        layer.mlp = make_ffn(i, bias)

    if "quantization" in config:
        nn.quantize(
            model,
            class_predicate=lambda p, m: hasattr(m, "to_quantized")
            and f"{p}.scales" in weights
            and infer_quant_config(p, m, weights),
        )
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise FlashFormatError(f"{fd.path}: resident weights do not match the architecture ({e})") from None
    mx.eval(model.parameters())
    model.eval()
    return model


def load_resident(path) -> Tuple[nn.Module, FlashDir]:
    """Load a flash directory with every FFN neuron resident (no streaming): the reference model."""
    fd = FlashDir(path)

    def make_ffn(i, bias):
        arrays = fd.unpack_layer(i)
        mx.eval(arrays)
        return ResidentFFN(fd.ffn, arrays, bias)

    return build_model(fd, make_ffn), fd


def load_tokenizer(fd: FlashDir):
    from mlx_lm.utils import load_tokenizer as _load

    return _load(fd.path, eos_token_ids=fd.config.get("eos_token_id"))
