"""Experts of mixture-of-experts models streamed from flash: an expert is a unit.

mlx-lm's MoE blocks (qwen3_moe, mixtral, deepseek_v3, gpt_oss, ...) route each token with their own router
and hand the chosen expert ids to a `SwitchGLU` (or, without a gate, a `SwitchMLP`). `FlashSwitchGLU` takes
that module's place, so the router, the shared experts and the weighting of the experts' outputs stay
mlx-lm's: the selection is the model's own top-k, exact. Per layer and forward pass:

    indices --host (the layer's one synchronisation)--> the union of the experts the tokens chose
      --the unit step (units.py), one block per expert--> each expert's gate / up / down computed from its row
      in place (cache or scratch), for the tokens that chose it
      the next MoE layer's router applied to this layer's input: its predicted experts read ahead into that
      layer's cache (read_ahead.py)

On flash each expert is one unit: its gate, up and down matrices (fc1 and fc2) (codes, scales, and biases where the
source has them: symmetric codes such as Q4_0 keep none) back to back, aligned so it is read straight
into its cache row (a Qwen3-30B-A3B Q4_0 expert, 2,654,208 B, needs no padding at 4 KiB).
"""

from functools import partial
from typing import Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

from ..compute import cpu_gemv
from ..compute import rows as row_rules
from ..compute.ops import gather
from ..errors import UnsupportedArchitectureError
from ..format import ggml
from ..format.quant import symmetric_biases
from .cache import UnitCache
from .read_ahead import IntoCache, ReadAhead
from .units import Engine

REGION = "experts"
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # a SwitchGLU's
MLP_PROJECTIONS = ("fc1", "fc2")  # a SwitchMLP's (no gate)
SWITCHES = (SwitchGLU, SwitchMLP)

# where mlx-lm's MoE blocks and routers keep the number of experts a token is routed to
TOP_K_NAMES = ("num_experts_per_tok", "top_k", "num_experts_per_token", "top_k_experts", "moe_topk", "moe_top_k", "k")


def projections(switch: nn.Module) -> tuple:
    return PROJECTIONS if isinstance(switch, SwitchGLU) else MLP_PROJECTIONS


def switch_paths(model: nn.Module) -> Dict[int, str]:
    """layer index -> module path of that layer's expert block, a SwitchGLU or SwitchMLP (layers without experts are
    left out).

    Raises UnsupportedArchitectureError for expert blocks mlx_flash cannot stream."""
    modules = dict(model.named_modules())
    paths = {}
    for i, layer in enumerate(model.layers):
        prefix = next(p for p, m in modules.items() if m is layer)
        found = [p for p, m in modules.items() if p.startswith(prefix + ".") and isinstance(m, SWITCHES)]
        if len(found) > 1:
            raise UnsupportedArchitectureError(f"layer {i} has {len(found)} expert blocks; one per layer is supported")
        if found:
            other = [
                k for k in modules[found[0]].children() if k not in (*projections(modules[found[0]]), "activation")
            ]
            if other:  # (they would leave with the experts)
                raise UnsupportedArchitectureError(
                    f"{found[0]}.{other[0]}: a module inside the expert block, where only the experts are expected"
                )
            paths[i] = found[0]
    if not paths:
        raise UnsupportedArchitectureError(f"{type(model).__module__}: no SwitchGLU or SwitchMLP expert block found")
    return paths


def _top_k_of(obj):
    """The number of experts per token `obj` (a module, or the args / config it holds) keeps, or None."""
    for holder in (obj, getattr(obj, "args", None), getattr(obj, "config", None)):
        for name in TOP_K_NAMES:
            k = holder.get(name) if type(holder) is dict else getattr(holder, name, None)
            if isinstance(k, int) and not isinstance(k, bool) and k > 0:
                return k
    return None


def experts_per_token(model: nn.Module, paths: Dict[int, str]) -> int:
    """The most experts a token is routed to in any layer, as the model's MoE blocks keep it: on the modules
    around the expert block (nearest first: the MoE block, up to the layer), their children (the router) or the args
    they hold; else on the model's args (or their text_config)."""
    modules = dict(model.named_modules())
    names = {id(m): p for p, m in modules.items()}
    args = getattr(model, "args", None)
    found = []
    for i, path in paths.items():
        k, layer = None, names[id(model.layers[i])]
        while k is None and path != layer:
            path = path.rsplit(".", 1)[0]
            k = _top_k_of(modules[path]) or next(filter(None, map(_top_k_of, _child_modules(modules[path]))), None)
        k = k or _top_k_of(args) or _top_k_of(getattr(args, "text_config", None))
        if k is None:
            raise UnsupportedArchitectureError(
                f"{paths[i]}: the number of experts per token is not found (none of {', '.join(TOP_K_NAMES)} on the "
                "modules around it, their routers or args)"
            )
        found.append(k)
    return max(found)


def _child_modules(module: nn.Module):
    return [m for m in module.children().values() if isinstance(m, nn.Module)]


def expert_arrays(switch: nn.Module) -> Dict[str, mx.array]:
    """An expert block's projections as unit components: 'gate_proj.weight' -> [n_experts, ...] (codes as stored)."""
    return {f"{p}.{k}": v for p in projections(switch) for k, v in tree_flatten(getattr(switch, p).parameters())}


# MLX's quantisation modes whose codes and scales an expert unit keeps as they are (no biases but affine's):
# gpt-oss ships its experts in mxfp4
MODES = ("affine", "mxfp4", "mxfp8", "nvfp4")


def expert_quantization(switch: nn.Module) -> Dict[str, dict]:
    """projection -> {"bits", "group_size"[, "mode"]} of a quantised expert block, None for float projections
    ("mode" only when not affine)."""
    out = {}
    for name in projections(switch):
        p = getattr(switch, name)
        mode = getattr(p, "mode", "affine")
        if mode not in MODES:
            raise UnsupportedArchitectureError(f"{name}: quantisation mode {mode!r} (one of {', '.join(MODES)})")
        if getattr(p, "global_scale", None) is not None:  # (nvfp4's optional global scale is not a unit's part)
            raise UnsupportedArchitectureError(f"{name}: quantisation with a global scale is not supported")
        out[name] = (
            {"bits": p.bits, "group_size": p.group_size, **({"mode": mode} if mode != "affine" else {})}
            if hasattr(p, "bits")
            else None
        )
    return out


class Router:
    """An MoE model's selector as `--stats` reports it: the model's own router (resident, exact)."""

    name = "router (the model's own top-k: exact)"
    nbytes = 0


class FlashSwitchGLU(nn.Module):
    """Replaces a SwitchGLU or SwitchMLP: its experts come from the engine's cache of layer `layer`; its activation
    stays."""

    def __init__(self, engine: "ExpertEngine", layer: int, activation):
        super().__init__()
        self._engine, self._layer, self._activation = engine, layer, activation

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        return self._engine.experts(self._layer, x, indices, self._activation)

    def blocks_sum(self, h: np.ndarray) -> Optional[np.ndarray]:
        """A dense FFN's blocks on host rows h (ExpertEngine.blocks_sum)."""
        return self._engine.blocks_sum(self._layer, h, self._activation)


def next_routers(model: nn.Module, paths: Dict[int, str]):
    """layer -> (next MoE layer, scale [D], its router): the router of the next layer with experts, and what turns
    this layer's expert input into that router's input as if the residual stream stopped here. Both blocks take
    RMSNorm(h) * w (their post-attention norms' weights), so x * w_next / w is RMSNorm(h) * w_next. The router is
    the block's `gate` (`router` in gpt-oss). Empty when a block has neither or its norm is not an RMSNorm (no
    read-ahead)."""
    modules = dict(model.named_modules())
    found = {}
    for i, path in paths.items():
        block, norm = modules[path.rsplit(".", 1)[0]], getattr(model.layers[i], "post_attention_layernorm", None)
        router = next(
            (r for r in (getattr(block, n, None) for n in ("gate", "router")) if isinstance(r, nn.Module)), None
        )
        if router is None or type(norm) is not nn.RMSNorm:
            return {}
        found[i] = (norm.weight.astype(mx.float32), router)
    order = sorted(found)
    out = {}
    for i, j in zip(order, order[1:]):
        w, w_next = found[i][0], found[j][0]
        out[i] = (j, mx.where(w == 0, 0.0, w_next / mx.where(w == 0, 1.0, w)), found[j][1])
    return out


# Read ahead while at least this share of the uncached experts guessed for a layer was routed to: a wrong guess
# costs a read and evicts an expert that may be routed to (sticky routing: most experts a token routes to are cached,
# so what the guess lacks is mostly wrong; uniform routing: it is mostly right). Below it, guess only every PROBE-th
# forward pass, to notice when guessing pays again.
PRECISION = 0.75
PROBE = 8
SORTED_PAIRS = 64  # mlx-lm's SwitchGLU sorts its (token, expert) pairs by expert from this many on


class Precision:
    """Right and all guesses, each layer's count weighing in with a decay: recent tokens' say."""

    DECAY = 0.98  # a layer's guesses (about a token of a 48-layer model) halve in weight after 34 layers

    def __init__(self):
        self.right = self.guessed = 0.0

    def add(self, right: int, guessed: int):
        self.right = self.right * self.DECAY + right
        self.guessed = self.guessed * self.DECAY + guessed

    def good(self) -> bool:
        return self.right >= PRECISION * self.guessed


class ExpertEngine(Engine):
    """Owns the reader, the per-layer expert caches, the scratch buffer and the stats of an MoE model."""

    def __init__(
        self,
        fd,
        reader,
        capacity: List[Dict[str, int]],
        scratch_bytes: int,
        policy: str = "lru",
        window: int = 5,
        compute_dtype=mx.float32,
    ):
        self.layout = fd.layouts[REGION]
        self.components = {c.name: c for c in self.layout.components}
        self.quant = fd.ffn["quantization"]
        self.compute_dtype = compute_dtype
        self.sparsifier = Router()
        self.why = None
        self.budget_note = None  # what load's --memory-budget auto found and chose
        self.route = None  # benchmarks: (layer, chosen experts) -> the experts to read instead (a replayed trace)
        self.routers, self.top_k = {}, 0  # the next layer's router per layer (read_ahead_with)
        self.guesses, self.precision = {}, Precision()  # layer -> the experts guessed for it, lacking; how right
        caches = [
            {
                REGION: UnitCache(
                    regions[REGION].n_units,
                    capacity[i].get(REGION, 0),
                    self.layout.stride,
                    policy=policy,
                    window=window,
                    alignment=fd.alignment,
                    compact=False,  # an expert is computed where it was read: no row moves on eviction
                )
            }
            if REGION in regions
            else {}
            for i, regions in enumerate(fd.layers)
        ]
        super().__init__(fd, reader, caches, max(scratch_bytes, self.layout.stride))
        # each layer's components where its rows hold them (experts read in place: the source's offsets, per layer)
        self.layer_components = [
            {c.name: c for c in fd.layout_of(i, REGION).components} if REGION in regions else None
            for i, regions in enumerate(fd.layers)
        ]
        # GGML blocks as a GGUF stores them (format/ggml.py): each projection's type in each layer
        paths = fd.ffn["switch_paths"]
        self.kinds = {n: ggml.layer_kinds(q, paths) for n, q in self.quant.items() if q is not None and "ggml" in q}
        self.row_layouts = [
            None
            if c is None
            else {n: self._row_layout(c, n) for n, q in self.quant.items() if q is not None and n not in self.kinds}
            for c in self.layer_components
        ]

    def read_ahead_with(self, routers: dict, top_k: int):
        """Read ahead the experts the next layer's router (next_routers) picks for each layer's input, up to top_k
        (a decode step's routing of one layer) into that layer's cache slots: no DRAM beside the caches."""
        self.routers, self.top_k = routers, top_k
        self.read_ahead = IntoCache(self, REGION, top_k)

    @classmethod
    def from_plan(cls, fd, plan, reader, policy: str = "lru", window: int = 5, compute_dtype=mx.float32):
        engine = cls(fd, reader, plan.capacity, min(plan.workspace // 2, plan.scratch), policy, window, compute_dtype)
        engine.plan = plan
        return engine

    # -- compute -----------------------------------------------------------------
    def _row_layout(self, components: dict, name: str) -> tuple:
        """QuantRows' fields of projection `name` within an expert's row (`components`: a layer's): (offset, stride)
        of weight, scales and biases (symmetric: none stored, none read; the scales stand in), then n, bits, group
        size, dtype, symmetric."""
        q, c = self.quant[name], {p: components[f"{name}.{p}"] for p in ("weight", "scales")}
        c["biases"] = components.get(f"{name}.biases", c["scales"])
        at = [v for p in ("weight", "scales", "biases") for v in (c[p].offset, c[p].nbytes // c[p].shape[0])]
        return (
            *at,
            c["weight"].shape[-1] * 32 // q["bits"],
            q["bits"],
            q["group_size"],
            getattr(mx, c["scales"].dtype),
            bool(q.get("symmetric")),
        )

    def _quant_rows(self, layer: int, host: np.ndarray, slot: int, name: str) -> "cpu_gemv.QuantRows":
        """Projection `name` of layer `layer`'s expert in row `slot` of `host` as the native kernels' rows (no copy,
        no view)."""
        w, ws, s, ss, b, bs, *rest = self.row_layouts[layer][name]  # computed once: this runs 3 times per expert
        base = slot * host.shape[1]
        return cpu_gemv.QuantRows(host, base + w, ws, host, base + s, ss, host, base + b, bs, *rest)

    def _native(self, rows: int, dtype, activation) -> bool:
        """Rows the native kernels compute whole (a decode step, a verification pass, a short prompt: up to
        cpu_gemv.NATIVE_ROWS tokens; any pass of the native step): float32 on the CPU, quantised SwiGLU experts."""
        return (
            cpu_gemv.native_rows(rows)
            and dtype == mx.float32
            and cpu_gemv.available()
            and type(activation).__name__ == "SwiGLU"
            and all(q is not None and "mode" not in q for q in self.quant.values())
            and "gate_proj.bias" not in self.components
        )

    def _block_dot(self, layer: int, x: np.ndarray, host: np.ndarray, slot: int, names: tuple) -> np.ndarray:
        """x [m, n] . the rows of projections `names` (GGML blocks of one type) of the expert in row `slot` of
        `host`: [m, out, len(names)]."""
        c, kind = self.layer_components[layer][f"{names[0]}.weight"], self.kinds[names[0]][str(layer)]
        base = slot * host.shape[1]
        offs = [base + self.layer_components[layer][f"{n}.weight"].offset for n in names]
        return cpu_gemv.block_dot(x, host, offs, c.shape[1], kind, self.quant[names[0]]["values"], k=c.shape[0])

    def _fused(self, layer: int):
        """f(x [m, D], addresses) -> [experts, m, D]: the SwiGLU experts of GGML blocks whose rows start at those
        addresses, in one native pass (cpu_gemv.expert_glu: `_expert_row`'s bits); None where gate and up differ in
        type or the experts are not GGML blocks."""
        if not self.kinds:
            return None
        kinds = [self.kinds[p][str(layer)] for p in PROJECTIONS]
        if kinds[0] != kinds[1]:
            return None
        c = [self.layer_components[layer][f"{p}.weight"] for p in PROJECTIONS]
        offs = tuple(x.offset for x in c)
        hidden, n_out = c[0].shape[0], c[2].shape[0]

        def run(x, at):
            return cpu_gemv.expert_glu(x, np.array(at, np.int64), offs, hidden, n_out, kinds[0], kinds[2])

        return run

    def _expert_row(self, layer: int, xv: np.ndarray, host: np.ndarray, slot: int) -> np.ndarray:
        """`_expert` of float32 rows xv [m, D] on the native kernels, straight from the cache row: the expert's
        bytes are read once for all m."""
        if self.kinds:
            pair = ("gate_proj", "up_proj")
            if self.kinds["gate_proj"][str(layer)] == self.kinds["up_proj"][str(layer)]:  # (read side by side)
                gu = self._block_dot(layer, xv, host, slot, pair)
            else:
                gu = np.concatenate([self._block_dot(layer, xv, host, slot, (n,)) for n in pair], -1)
            return self._block_dot(layer, cpu_gemv.glu_pairs(gu), host, slot, ("down_proj",))[..., 0]
        gate, up = (self._quant_rows(layer, host, slot, name) for name in ("gate_proj", "up_proj"))
        gu = cpu_gemv.row_dot_pairs(xv, gate, up, k=self.components["gate_proj.weight"].shape[0])
        return cpu_gemv.row_dot(
            cpu_gemv.glu_pairs(gu),
            self._quant_rows(layer, host, slot, "down_proj"),
            k=self.components["down_proj.weight"].shape[0],
        )

    def experts(self, layer: int, x: mx.array, indices: mx.array, activation) -> mx.array:
        """SwitchGLU(x, indices) (or SwitchMLP's): [..., k, D], each token's output of each expert it chose."""
        prefill = indices.size > indices.shape[-1]
        return self.guarded(layer, prefill, lambda: self._experts(layer, x, indices, activation))

    def _predict(self, layer: int, x: mx.array):
        """The next layer's top-k experts for each token of this layer's expert input x [..., D] (lazy), or None."""
        if self.read_ahead is None or layer not in self.routers:
            return None
        if not self.precision.good() and len(self.stats.tokens) % PROBE:  # guessing wrong: only now and then
            return None
        _, scale, gate = self.routers[layer]
        logits = gate((x * scale).astype(x.dtype))
        if isinstance(logits, tuple):  # a router that picks itself (DeepSeek's grouped top-k): (indices, scores)
            return logits[0]
        return mx.argpartition(-logits, self.top_k - 1, axis=-1)[..., : self.top_k]

    def _read_next(self, layer: int, predicted: np.ndarray):
        """Read the predicted experts of the next MoE layer that its cache lacks (most-voted first, top_k of them)
        into its cache, while such guesses have been right (`precision`) and the cache holds a token's experts."""
        target = self.routers[layer][0]
        ids, votes = np.unique(predicted, return_counts=True)
        lacking = ~self.caches[target][REGION].contains(ids)
        missing = ids[lacking][np.argsort(-votes[lacking], kind="stable")][: self.read_ahead.rows]
        self.guesses[target] = missing
        # (a cache that holds fewer than a token's experts streams the rest, and their reads would queue behind)
        if self.precision.good() and self.caches[target][REGION].capacity >= self.top_k:
            self.read_ahead.start(target, missing, predicted=ids)

    def _score(self, layer: int, units: np.ndarray):
        """Count how many of the experts guessed for this layer (read ahead or not) it routed to."""
        guess = self.guesses.pop(layer, None)
        if guess is not None and len(guess):
            self.precision.add(int(np.isin(guess, units).sum()), len(guess))

    def _experts(self, layer: int, x: mx.array, indices: mx.array, activation) -> mx.array:
        shape, k = indices.shape, indices.shape[-1]
        xf = x.reshape(-1, x.shape[-1]).astype(self.compute_dtype)
        ahead = self._predict(layer, x.astype(self.compute_dtype))  # in the shape its block gives a router
        mx.eval(indices, *([] if ahead is None else [ahead]))  # the layer's one synchronisation
        self.stats.current.syncs += 1
        chosen = np.array(indices).reshape(-1)  # the router's choice
        if self.route is not None:
            chosen = self.route(layer, chosen)
        read_next = None if ahead is None else (lambda: self._read_next(layer, np.array(ahead)))
        if self._native(xf.shape[0], xf.dtype, activation):
            y = mx.array(self._host_experts(layer, np.asarray(xf), chosen, k, read_next))
        else:
            y = self._mlx_experts(layer, xf, chosen, k, read_next, activation)
        return y.reshape(*shape, x.shape[-1]).astype(x.dtype)

    def blocks_sum(self, layer: int, h: np.ndarray, activation) -> Optional[np.ndarray]:
        """A dense FFN's blocks (models/blocked.py) on host rows h [m, D] (float32), natively and with no MLX op: every
        block's output, summed in block order (the native decode step's FFN for such a model); None where the native
        kernels do not compute them."""
        if not self._native(len(h), mx.float32, activation):
            return None
        E = self.caches[layer][REGION].n_units
        compute = lambda: self._host_experts(layer, h, np.tile(np.arange(E), len(h)), E, None)  # noqa: E731
        return self.guarded(layer, len(h) > 1, compute).reshape(len(h), E, -1).sum(axis=1)

    def _route(self, layer: int, chosen: np.ndarray):
        """(units, by_unit, pairs) of the (token, choice) pairs `chosen`: the distinct units, the pairs grouped by
        unit, and each unit's pairs."""
        units, inverse = np.unique(chosen, return_inverse=True)
        self.stats.current.active.append(len(units))
        self._score(layer, units)
        by_unit = np.argsort(inverse, kind="stable")  # (token, choice) pairs, grouped by the expert they chose
        return units, by_unit, np.split(by_unit, np.cumsum(np.bincount(inverse, minlength=len(units)))[:-1])

    def _run(self, layer: int, units: np.ndarray, fn, native: bool, read_next):
        """Each unit's output (a list), from the cache, its reads and the streamed rest (Engine.step)."""
        if isinstance(self.read_ahead, ReadAhead):  # a dense FFN's blocks: the next layer's overflow (load)
            read_next = partial(self.read_overflow, layer, REGION)
        return self.step(
            layer, REGION, units, fn, (lambda out: None) if native else mx.eval, block=1,
            per=None if native else self.gathered_units(REGION), read_next=read_next,
        )  # fmt: skip

    def _host_experts(self, layer: int, xv: np.ndarray, chosen: np.ndarray, k: int, read_next) -> np.ndarray:
        """[tokens * k, D]: each (token, choice) pair's expert output for float32 host rows xv [tokens, D], on the
        native kernels."""
        units, by_unit, pairs = self._route(layer, chosen)
        hosts = {}  # buffer -> its numpy view (the native kernels read rows in place)
        fused = self._fused(layer)

        def fn(rows, slots, positions, dst, n):  # one block per expert: its output for the tokens that chose it
            at = []
            for j in range(len(positions)):
                part, slot = (rows.parts[rows.which[j]], int(rows.slots[j])) if slots is None else (rows, int(slots[j]))
                host = hosts.get(id(part))
                if host is None:
                    host = hosts[id(part)] = np.asarray(memoryview(part))
                at.append((host, slot))
            tokens = [pairs[i] // k for i in positions]
            same = all(np.array_equal(t, tokens[0]) for t in tokens)  # (a decode step; a dense FFN's blocks)
            if fused and same:  # the call's experts in one pass
                return list(fused(xv[tokens[0]], [h.ctypes.data + s * h.shape[1] for h, s in at]))
            return [
                fused(xv[t], [h.ctypes.data + s * h.shape[1]])[0] if fused else self._expert_row(layer, xv[t], h, s)
                for t, (h, s) in zip(tokens, at)
            ]

        outs = self._run(layer, units, fn, True, read_next)
        return np.concatenate(outs)[np.argsort(by_unit)]  # to (token, choice) order

    def _mlx_experts(self, layer: int, xf: mx.array, chosen: np.ndarray, k: int, read_next, activation) -> mx.array:
        """`_host_experts` in MLX's ops: each call's experts in one product a matrix."""
        units, by_unit, pairs = self._route(layer, chosen)

        def switch(rows, slots, positions, dst, n):
            if slots is None:
                rows, slots = rows.gather(), np.arange(len(rows))
            chosen = [pairs[i] for i in positions]
            which = np.repeat(np.arange(len(chosen), dtype=np.uint32), [len(c) for c in chosen])
            tokens, sl = np.concatenate(chosen) // k, mx.array(np.asarray(slots, np.int32))
            lengths = row_rules.segments()
            if lengths is None or row_rules.independent(True):
                return self._switch(layer, xf[mx.array(tokens)], rows, sl, which, activation)
            # (each sequence's pairs as a pass of it alone computes them: a GPU's products depend on their rows)
            seq = np.searchsorted(np.cumsum(lengths), tokens, side="right")
            picks = [np.flatnonzero(seq == s) for s in np.unique(seq)]
            ys = [self._switch(layer, xf[mx.array(tokens[p])], rows, sl, which[p], activation) for p in picks]
            return mx.concatenate(ys)[mx.array(np.argsort(np.concatenate(picks)))]

        outs = self._run(layer, units, switch, False, read_next)
        return mx.concatenate(outs, axis=0)[mx.array(np.argsort(by_unit))]

    def _switch(self, layer: int, x: mx.array, rows, slots: mx.array, which: np.ndarray, activation) -> mx.array:
        """mlx-lm's SwitchGLU / SwitchMLP on x [P, D], pair p through expert rows[slots[which[p]]]: each matrix's
        rows gathered once for the call, each pair a row of MLX's gathered products (as SwitchGLU computes them:
        a pair's output does not depend on the others, pairs sorted by expert as larger calls sort them)."""
        idx = mx.array(which)
        ordered = len(which) >= SORTED_PAIRS  # (grouped by expert already)

        def project(h, name):
            q, p = self.quant[name], {}
            for part in ("weight", "scales", "biases", "bias"):
                c = self.layer_components[layer].get(f"{name}.{part}")
                p[part] = None if c is None else gather(rows, slots, c)
            kind = self.kinds[name][str(layer)] if name in self.kinds else None
            if kind in ggml.AFFINE:  # GGML blocks that are MLX's affine codes: repacked, MLX's quantised product
                p["weight"], p["scales"], p["biases"], bits = ggml.to_affine(p["weight"], kind)
                q = {"bits": bits, "group_size": 32}
            if kind is not None and kind not in ggml.AFFINE:  # the others dequantised (llama.cpp's arithmetic)
                w = ggml.dequantize(p["weight"], kind).astype(h.dtype)
                y = mx.gather_mm(h, w.swapaxes(-1, -2), rhs_indices=idx, sorted_indices=ordered)
            elif q is None:
                y = mx.gather_mm(h, p["weight"].swapaxes(-1, -2), rhs_indices=idx, sorted_indices=ordered)
            else:
                if q.get("symmetric"):
                    p["biases"] = symmetric_biases(p["scales"], q["bits"])
                extra = {"mode": q["mode"]} if "mode" in q else {}
                y = mx.gather_qmm(
                    h, p["weight"], p["scales"], p["biases"], rhs_indices=idx, transpose=True,
                    group_size=q["group_size"], bits=q["bits"], sorted_indices=ordered, **extra,
                )  # fmt: skip
            return y if p["bias"] is None else y + p["bias"][idx][:, None].astype(y.dtype)

        h = x[:, None]
        if "fc1" in self.quant:
            return project(activation(project(h, "fc1")), "fc2")[:, 0]
        return project(activation(project(h, "up_proj"), project(h, "gate_proj")), "down_proj")[:, 0]
