"""The FFN computed from canonical neuron rows (see architectures.py).

    glu:  y = W_down[:, S] (act(W_gate[S] x) * (W_up[S] x))
    relu: y = W_fc2[:, S] relu(W_fc1[S] x + b1[S]) + b2

`arrays` holds the stored rows of the active units (all of them when
everything is resident); quantised rows go through MLX's quantised matmuls, or for one
float32 row on the CPU the native ones (cpu_gemv.py).
"""

from typing import Dict, Optional

import mlx.core as mx
import mlx.nn as nn

from . import cpu_gemv

ACTIVATIONS = {"silu": nn.silu, "gelu_approx": nn.gelu_approx, "relu": nn.relu}


def glu(gate: mx.array, up: mx.array, activation: str) -> mx.array:
    """act(gate) * up: a GLU FFN's hidden units from its gate and up projections."""
    return ACTIVATIONS[activation](gate) * up


def project(
    x: mx.array, arrays: Dict[str, mx.array], name: str, info: dict, resident: Optional[Dict[str, mx.array]] = None
) -> mx.array:
    """x times one stored FFN matrix.

    Stored rows are [out, in] (y = x @ rows^T) unless info["transposed"], when they
    are [in, out] (y = x @ rows), as for down/fc2 and the dip layout's gate/up.
    Rows of source codes (quantisation "resident_scales") take their groups' scales and biases
    from `resident` ("down.scales" / "down.biases"; no biases: symmetric).
    """
    w, quant = arrays[f"{name}.weight"], info["quantization"]
    if quant is None:
        return x @ w if info["transposed"] else x @ w.T
    if quant.get("resident_scales"):
        blocks = mx.arange(w.shape[0]) // quant["group_size"]
        return cpu_gemv.block_matmul(
            x, w, blocks, resident[f"{name}.scales"], resident.get(f"{name}.biases"), quant["bits"]
        )
    s, b, gs, bits = arrays[f"{name}.scales"], arrays[f"{name}.biases"], quant["group_size"], quant["bits"]
    return cpu_gemv.quantized_matmul(x, w, s, b, gs, bits, transpose=not info["transposed"])


def ffn_forward(
    x: mx.array, arrays: Dict[str, mx.array], ffn: dict, bias: Optional[Dict[str, mx.array]] = None
) -> mx.array:
    """The FFN of the units in `arrays`; `ffn` is the manifest's ffn section, `bias` the resident biases."""
    m = ffn["matrices"]
    act = ACTIVATIONS[ffn["activation"]]
    bias = bias or {}
    if ffn["kind"] == "glu":
        h = glu(project(x, arrays, "gate", m["gate"]), project(x, arrays, "up", m["up"]), ffn["activation"])
        return project(h, arrays, "down", m["down"], bias)
    h = project(x, arrays, "fc1", m["fc1"])
    if "fc1" in bias:
        h = h + bias["fc1"]
    y = project(act(h), arrays, "fc2", m["fc2"], bias)
    if "fc2" in bias:
        y = y + bias["fc2"]
    return y


class ResidentFFN(nn.Module):
    """Every neuron of one layer held in memory: the reference the streaming FFN must equal."""

    def __init__(self, ffn: dict, arrays: Dict[str, mx.array], bias: Dict[str, mx.array]):
        super().__init__()
        # Underscored: not parameters (they come from ffn.bin, not resident.safetensors).
        self._ffn, self._arrays, self._bias = ffn, arrays, bias

    def __call__(self, x):
        return ffn_forward(x, self._arrays, self._ffn, self._bias)

    @property
    def parts(self):
        """(the manifest's ffn section, the layer's arrays, its resident biases)."""
        return self._ffn, self._arrays, self._bias
