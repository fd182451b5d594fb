"""Model classes mlx_flash adds to mlx-lm's.

`get_model_classes(config)` is what mlx_flash passes as `get_model_classes=` to
`mlx_lm.utils.load_model`: it knows the architectures mlx-lm lacks (OPT; hunyuan_moe, Hunyuan-A13B's routing
as its reference has it) and otherwise defers to mlx-lm.

Beside them: what a config's model is made of (inspect.py), the architectures' FFN adapters (architectures.py) and
a pipeline stage's layers as a flash directory of their own (stage.py). With the loader, above the engine.
"""

from typing import Tuple, Type

import mlx.nn as nn

from ..errors import UnsupportedArchitectureError
from .blocked import UNITS, blocked_class

# model_type -> module under mlx_flash.models
_LOCAL_MODELS = {"opt": "opt", "hunyuan_moe": "hunyuan_moe"}


def get_model_classes(config: dict) -> Tuple[Type[nn.Module], Type]:
    """(Model, ModelArgs) for `config["model_type"]`.

    Raises UnsupportedArchitectureError when neither mlx_flash nor mlx-lm
    knows the model type. A config with blocked.UNITS gets its FFNs as blocks of neurons (blocked.py).
    """
    classes = _model_classes(config)
    units = config.get(UNITS)
    return (blocked_class(classes[0], int(units)), classes[1]) if units else classes


def _model_classes(config: dict) -> Tuple[Type[nn.Module], Type]:
    model_type = config.get("model_type")
    if model_type is None:
        raise UnsupportedArchitectureError("The model config has no 'model_type'; cannot pick an architecture.")
    if model_type in _LOCAL_MODELS:
        import importlib

        module = importlib.import_module(f"{__name__}.{_LOCAL_MODELS[model_type]}")
        return module.Model, module.ModelArgs

    from mlx_lm.utils import _get_classes

    try:
        return _get_classes(config)
    except ValueError as e:
        raise UnsupportedArchitectureError(
            f"Model type {model_type!r} is not supported: neither mlx_flash "
            f"(which adds {sorted(_LOCAL_MODELS)}) nor the installed mlx-lm "
            f"has an implementation of it."
        ) from e


__all__ = ["get_model_classes"]
