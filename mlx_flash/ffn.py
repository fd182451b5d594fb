"""The FFN computed from canonical neuron rows (see architectures.py).

    glu:  y = down[S]^T-rows . (act(gate[S] x) * (up[S] x))
    relu: y = fc2[S]-rows . relu(fc1[S] x + b1[S]) + b2

`rows` holds the rows of the active set S (all neurons when everything is
resident); quantised rows go through MLX's quantised matmuls.
"""

from typing import Dict, Optional

import mlx.core as mx
import mlx.nn as nn

ACTIVATIONS = {"silu": nn.silu, "gelu_approx": nn.gelu_approx, "relu": nn.relu}


def rows_matmul(x: mx.array, rows: Dict[str, mx.array], name: str, quant: Optional[dict]) -> mx.array:
    """x [.., d] times the neuron rows of matrix `name` [k, d] -> [.., k]."""
    w = rows[f"{name}.weight"]
    if quant is None:
        return x @ w.T
    return mx.quantized_matmul(
        x, w, rows[f"{name}.scales"], rows[f"{name}.biases"], True, quant["group_size"], quant["bits"]
    )


def cols_matmul(h: mx.array, rows: Dict[str, mx.array], name: str, quant: Optional[dict]) -> mx.array:
    """h [.., k] times the transposed down/fc2 rows [k, d] -> [.., d]."""
    w = rows[f"{name}.weight"]
    if quant is None:
        return h @ w
    return mx.quantized_matmul(
        h, w, rows[f"{name}.scales"], rows[f"{name}.biases"], False, quant["group_size"], quant["bits"]
    )


def ffn_forward(x: mx.array, rows: Dict[str, mx.array], ffn: dict, bias: Optional[Dict[str, mx.array]] = None) -> mx.array:
    """The FFN of the neurons in `rows`; `ffn` is the manifest's ffn section, `bias` the resident biases of those neurons."""
    q = {name: m["quantization"] for name, m in ffn["matrices"].items()}
    act = ACTIVATIONS[ffn["activation"]]
    if ffn["kind"] == "glu":
        h = act(rows_matmul(x, rows, "gate", q["gate"])) * rows_matmul(x, rows, "up", q["up"])
        return cols_matmul(h, rows, "down", q["down"])
    h = rows_matmul(x, rows, "fc1", q["fc1"])
    if bias is not None and "fc1" in bias:
        h = h + bias["fc1"]
    y = cols_matmul(act(h), rows, "fc2", q["fc2"])
    if bias is not None and "fc2" in bias:
        y = y + bias["fc2"]
    return y


class ResidentFFN(nn.Module):
    """Every neuron of one layer held in memory: the reference the streaming FFN must equal."""

    def __init__(self, ffn: dict, rows: Dict[str, mx.array], bias: Dict[str, mx.array]):
        super().__init__()
        # Underscored: not parameters (they come from ffn.bin, not resident.safetensors).
        self._ffn, self._rows, self._bias = ffn, rows, bias

    def __call__(self, x):
        return ffn_forward(x, self._rows, self._ffn, self._bias)
