"""A dense model's FFN as blocks of its neurons, each block an expert that every token is routed to.

A GGUF's K-quant down projection holds a neuron's column across blocks of 256 neurons (super-blocks along the FFN
width), so a neuron alone cannot be read as the file stores it; 256 neurons can: their gate and up rows, and one
block of every down row. With such a block as a unit the FFN is

    down(silu(gate(x)) * up(x)) = sum over blocks b of down_b(silu(gate_b(x)) * up_b(x))

mlx-lm's SwitchGLU over the blocks with every block chosen, summed: the expert engine (engine/experts.py) streams,
caches and computes the blocks as the file's own bytes (format/ggml.py), with the same bits at every budget.
A config holding UNITS is built this way (`get_model_classes`); the GLU must be SiLU's (SwitchGLU's).
"""

from functools import lru_cache

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchGLU

from ..errors import UnsupportedArchitectureError
from ..format.config import UNITS

__all__ = ["UNITS", "BlockedMLP", "blocked", "blocked_class"]


class BlockedMLP(nn.Module):
    """A SiLU GLU FFN of `hidden` neurons as hidden / units experts of `units` neurons, every one chosen."""

    def __init__(self, dims: int, hidden: int, units: int, bias: bool = False):
        super().__init__()
        if hidden % units:
            raise UnsupportedArchitectureError(f"an FFN of {hidden} neurons is not whole blocks of {units}")
        self.num_experts_per_tok = hidden // units
        self.switch_mlp = SwitchGLU(dims, units, hidden // units, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        k = self.num_experts_per_tok
        every = mx.broadcast_to(mx.arange(k, dtype=mx.uint32), (*x.shape[:-1], k))
        return self.switch_mlp(x, every).sum(axis=-2)

    def blocks_sum(self, h):
        """The FFN of host rows h [m, D] (float32) natively with no MLX op (FlashSwitchGLU.blocks_sum), or None."""
        return self.switch_mlp.blocks_sum(h) if hasattr(self.switch_mlp, "blocks_sum") else None


def blocked(mlp: nn.Module, units: int) -> BlockedMLP:
    """`mlp` (mlx-lm's gate_proj / up_proj / down_proj FFN) as a BlockedMLP of the same shape."""
    children = set(mlp.children())
    if children != {"gate_proj", "up_proj", "down_proj"}:
        raise UnsupportedArchitectureError(f"{type(mlp).__name__}: an FFN of {sorted(children)}, not a GLU's")
    hidden, dims = mlp.gate_proj.weight.shape
    return BlockedMLP(dims, hidden, units, bias="bias" in mlp.gate_proj)


@lru_cache(maxsize=None)
def blocked_class(model_class: type, units: int) -> type:
    """`model_class` with every layer's FFN `blocked`."""

    class Model(model_class):
        def __init__(self, args):
            super().__init__(args)
            for layer in self.layers:
                layer.mlp = blocked(layer.mlp, units)

    Model.__module__, Model.__qualname__ = model_class.__module__, model_class.__qualname__
    return Model
