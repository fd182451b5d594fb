"""What a config's model is made of, asked of mlx-lm's (or mlx_flash's) model of it with lazy weights."""

import mlx.nn as nn

from ..engine.experts import SWITCHES
from ..errors import UnsupportedArchitectureError
from . import get_model_classes


def instantiate(config: dict) -> nn.Module:
    """mlx-lm's model of `config` with lazy random weights (nothing allocated or read): what a model is made of is
    asked of it, as its config keys differ between architectures."""
    model_class, args_class = get_model_classes(config)
    try:
        return model_class(args_class.from_dict(config))
    except Exception as e:
        why = (str(e).splitlines() or [""])[0]
        raise UnsupportedArchitectureError(
            f"architecture {config['model_type']!r} is not supported: mlx-lm cannot build it from this config "
            f"({type(e).__name__}: {why})"
        ) from e


def is_moe(config: dict) -> bool:
    """Whether mlx-lm's model of `config` routes tokens to experts (has SwitchGLU / SwitchMLP blocks)."""
    return any(isinstance(m, SWITCHES) for _, m in instantiate(config).named_modules())
