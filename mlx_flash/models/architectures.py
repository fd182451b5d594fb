"""FFN adapters: how each architecture's MLP maps onto neuron bundles.

Every supported model exposes its FFN as `model.layers[i].mlp`. An adapter turns
that module into canonical per-neuron rows:

    SwiGLU-style ("glu"):  gate [n, d], up [n, d], down [n, d]   (down = W_down^T)
    ReLU-style   ("relu"): fc1  [n, d], fc2 [n, d]               (fc2 = W_fc2^T)

Row i of every matrix belongs to neuron i, so a bundle is the concatenation of
row i of each. The "dip" layout (GLU only) instead stores gate/up by input
column, since DIP prunes their inputs, and down by neuron. Quantised rows (MLX affine
quantisation groups run along d) are stored as their .weight/.scales/.biases rows. The transposed down/fc2 rows
cannot keep the source quantisation (its groups span 32 neurons), so they are
dequantised and either re-quantised along d_model or kept in float, or (`resident_scales`)
stored as the source's codes with the groups' scales and biases resident.
"""

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from ..errors import UnsupportedArchitectureError
from ..format.quant import is_symmetric
from . import get_model_classes


@dataclass(frozen=True)
class FFNAdapter:
    kind: str  # "glu" or "relu"
    activation: str  # "silu", "gelu_approx", "relu"
    names: Tuple[str, ...]  # module names inside the arch's mlp: (gate, up, down) / (fc1, fc2) / (gate_up, down)
    fused_gate_up: bool = False

    @property
    def row_matrices(self) -> Tuple[str, ...]:
        return ("gate", "up") if self.kind == "glu" else ("fc1",)

    @property
    def col_matrix(self) -> str:
        return "down" if self.kind == "glu" else "fc2"

    @property
    def matrices(self) -> Tuple[str, ...]:
        return self.row_matrices + (self.col_matrix,)

    def layouts(self) -> Tuple[str, ...]:
        """On-disk layouts this FFN supports: "neurons" bundles, and "dip" (input columns + down rows) for GLU."""
        return ("neurons", "dip") if self.kind == "glu" else ("neurons",)

    def split(
        self,
        mlp: nn.Module,
        quantization: Dict[str, Optional[dict]],
        layout: str = "neurons",
        prune: Optional[Callable[[str, mx.array], mx.array]] = None,
    ):
        """mlp module -> ({region: {"gate.weight": [n_units, ...], ...}}, resident biases, ffn matrix info).

        layout "neurons": one unit per neuron i = [gate_i | up_i | down_i] (ReLU: [fc1_i | fc2_i]).
        layout "dip": units per input dim j = [gate[:, j] | up[:, j]] in region "inputs", and
        down_i per neuron in region "neurons" (DIP prunes gate/up by input column).
        `quantization` maps each matrix to {"bits", "group_size"} or None (float). Rows stored in
        the source's orientation and quantisation are copied bit-exactly; others are quantised
        once from the dense weights along the stored row.
        Biases (ReLU models) stay resident under their canonical names.
        `prune(matrix name, dense stored rows) -> rows` (e.g. Wanda) is applied before any
        quantisation; every row then goes through the dense path.
        """
        if layout not in self.layouts():
            raise UnsupportedArchitectureError(f"layout {layout!r} is not available for {self.kind} FFNs")
        linears = self.linears(mlp)
        regions, resident, info = {}, {}, {}
        for name in self.matrices:
            lin, quant = linears[name], quantization[name]
            transposed = name == self.col_matrix or layout == "dip"
            region = "inputs" if layout == "dip" and name != self.col_matrix else "neurons"
            if prune is None and not transposed and _quant_of(lin) == _bits(quant):
                arrays = {k: lin[k] for k in ("weight", "scales", "biases") if k in lin}
                if quant is not None and quant.get("symmetric") and _require_symmetric(lin, name):
                    del arrays["biases"]
            elif quant is not None and quant.get("resident_scales"):
                arrays, tables = _source_columns(lin, quant, name)
                if quant.get("symmetric") and _require_symmetric(lin, name):
                    tables.pop("biases")
                resident.update({f"{name}.{k}": v for k, v in tables.items()})
            else:
                rows = _dense_weight(lin)
                rows = rows.T if transposed else rows
                if prune is not None:
                    rows = prune(name, rows)
                if quant is None:
                    arrays = {"weight": rows}
                else:
                    w, sc, b = mx.quantize(rows, quant["group_size"], quant["bits"])
                    arrays = {"weight": w, "scales": sc, "biases": b}
            regions.setdefault(region, {}).update({f"{name}.{k}": v for k, v in arrays.items()})
            if "bias" in lin:
                resident[f"{name}.bias"] = lin["bias"]
            info[name] = {"quantization": quant, "transposed": transposed, "region": region}
        return regions, resident, info

    def linears(self, mlp: nn.Module) -> Dict[str, nn.Module]:
        """{canonical matrix name: the linear module} of an mlp (a fused gate_up split in two)."""
        if not self.fused_gate_up:
            return {m: getattr(mlp, n) for m, n in zip(self.matrices, self.names)}
        gate_up, down = getattr(mlp, self.names[0]), getattr(mlp, self.names[1])
        gate, up = _split_rows(gate_up)
        return {"gate": gate, "up": up, "down": down}


def _split_rows(lin: nn.Module) -> Tuple[nn.Module, nn.Module]:
    """A fused [2n, d] linear -> two [n, d] linears (quantised rows split alike)."""
    halves = []
    for part in (0, 1):
        m = nn.Module()
        for key in ("weight", "scales", "biases", "bias"):
            if key in lin:
                a = lin[key]
                n = a.shape[0] // 2
                m[key] = a[part * n : (part + 1) * n]
        if isinstance(lin, nn.QuantizedLinear):
            m.bits, m.group_size, m.mode = lin.bits, lin.group_size, lin.mode
        halves.append(m)
    return tuple(halves)


def _quant_of(lin) -> Optional[dict]:
    if "scales" not in lin:
        return None
    mode = getattr(lin, "mode", "affine")
    if mode != "affine":
        raise UnsupportedArchitectureError(f"quantisation mode {mode!r} is not supported (only affine)")
    return {"bits": lin.bits, "group_size": lin.group_size}


def _bits(quant: Optional[dict]) -> Optional[dict]:
    return None if quant is None else {"bits": quant["bits"], "group_size": quant["group_size"]}


def symmetric(lin) -> bool:
    """Whether a quantised linear's biases are -2^(bits-1) times its scales (llama.cpp's Q4_0 / Q8_0): then
    they need not be stored."""
    q = _quant_of(lin)
    return q is not None and is_symmetric(lin["biases"], lin["scales"], q["bits"])


def _require_symmetric(lin, name) -> bool:
    if not symmetric(lin):
        raise UnsupportedArchitectureError(
            f"{name}: quantisation not symmetric in this layer, as in the first "
            "(llama.cpp type mixed per layer): convert without --down-bits source"
        )
    return True


def _source_columns(lin, quant: dict, name: str):
    """A matrix quantised along its input ([out, n_in], groups of `group_size` inputs) as per-input rows of
    its codes, exactly: ({"weight": [n_in, out * bits / 32] uint32}, {"scales", "biases": [n_in / group_size, out]}),
    the tables to keep resident (W[:, i] = scales[i // group_size] * q_i + biases[i // group_size])."""
    want = _bits(quant)
    if _quant_of(lin) is None:  # a float source quantised now, as mlx-lm would store it
        w, scales, biases = mx.quantize(lin["weight"], quant["group_size"], quant["bits"])
    elif _quant_of(lin) == want:
        w, scales, biases = lin["weight"], lin["scales"], lin["biases"]
    else:
        raise UnsupportedArchitectureError(
            f"{name}: stored as {_quant_of(lin)}, so its codes cannot be kept as {want} (--down-bits source)"
        )
    return {"weight": transpose_codes(w, quant["bits"])}, {"scales": scales.T, "biases": biases.T}


def transpose_codes(w: mx.array, bits: int, chunk_values: int = 1 << 22) -> mx.array:
    """Packed codes of a [rows, n] matrix (uint32 [rows, n * bits / 32], MLX's packing: least significant
    first) -> the packed codes of its transpose [n, rows * bits / 32].

    The codes are unpacked to 4 bytes each on the way: a large matrix is done `chunk_values` codes at a time, each
    block evaluated, so that memory holds a block's unpacked codes, not the whole matrix's."""
    per = 32 // bits
    step = max(1, chunk_values // (w.shape[0] * per))  # packed columns per block
    if w.shape[1] > step:
        parts = []
        for j in range(0, w.shape[1], step):
            parts.append(transpose_codes(w[:, j : j + step], bits, chunk_values))
            mx.eval(parts[-1])
        return mx.concatenate(parts, axis=0)
    shifts = mx.arange(per, dtype=mx.uint32) * bits
    codes = ((w[..., None] >> shifts) & ((1 << bits) - 1)).reshape(w.shape[0], -1).T  # [n, rows]
    return (codes.reshape(codes.shape[0], -1, per) << shifts).sum(axis=-1).astype(mx.uint32)


def _dense_weight(lin) -> mx.array:
    q = _quant_of(lin)
    if q is None:
        return lin["weight"]
    return mx.dequantize(lin["weight"], lin["scales"], lin["biases"], q["group_size"], q["bits"])


_LLAMA = FFNAdapter("glu", "silu", ("gate_proj", "up_proj", "down_proj"))

ADAPTERS: Dict[str, FFNAdapter] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": _LLAMA,
    "gemma3_text": FFNAdapter("glu", "gelu_approx", ("gate_proj", "up_proj", "down_proj")),
    "phi3": FFNAdapter("glu", "silu", ("gate_up_proj", "down_proj"), fused_gate_up=True),
    "opt": FFNAdapter("relu", "relu", ("fc1", "fc2")),
}


def adapter_for(config: dict) -> FFNAdapter:
    model_type = config.get("model_type")
    if model_type not in ADAPTERS:
        experts = _other_experts(config)
        why = (
            f"its experts, {experts}, are not a SwitchGLU or SwitchMLP"
            if experts
            else f"supported: {', '.join(sorted(ADAPTERS))} and mixtures of experts"
        )
        raise UnsupportedArchitectureError(f"architecture {model_type!r} is not supported by mlx_flash ({why})")
    if model_type == "opt" and config.get("activation_function", "relu") != "relu":
        raise UnsupportedArchitectureError(f"OPT with activation {config['activation_function']!r} is not supported")
    return ADAPTERS[model_type]


def _other_experts(config: dict) -> Optional[str]:
    """Where mlx-lm's model of `config` keeps experts that are not the SwitchGLU / SwitchMLP blocks an MoE is
    streamed by (dbrx: a list of MLPs per layer), or None."""
    try:
        model_class, args_class = get_model_classes(config)
        model = model_class(args_class.from_dict(config))
    except Exception:  # (an architecture mlx-lm cannot build says so elsewhere)
        return None
    paths = (p.split(".") for p, _ in model.named_modules())
    return min((".".join(p[: p.index("experts") + 1]) for p in paths if "experts" in p), default=None)
