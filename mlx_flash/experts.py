"""Experts of mixture-of-experts models streamed from flash: an expert is a unit.

mlx-lm's MoE blocks (qwen3_moe, qwen2_moe, mixtral, olmoe, ...) route each token with their own router
and hand the chosen expert ids to a `SwitchGLU`. `FlashSwitchGLU` takes that module's place, so the
router, the shared experts and the weighting of the experts' outputs stay mlx-lm's: the selection is the
model's own top-k, exact. Per layer and forward pass:

    indices --host (the layer's one synchronisation)--> the union of the experts the tokens chose
      --UnitCache.plan--> hits + misses;  misses --reader (pread pool)--> cache rows, one read per expert
      (the cache is smaller than the union: the rest through the scratch buffer, uncached)
      each expert's gate / up / down computed from its cache row in place, for the tokens that chose it

On flash each expert is one unit: its gate, up and down matrices (codes, scales, and biases where the
source has them: symmetric codes such as Q4_0 keep none) back to back, aligned so it is read straight
into its cache row (a Qwen3-30B-A3B Q4_0 expert, 2,654,208 B, needs no padding at 4 KiB).
"""

import time
from typing import Dict, List

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import SwitchGLU

from . import cpu_gemv
from .errors import ReadError, UnsupportedArchitectureError
from .runtime import AlignedBuffer, Engine
from .stats import Stats
from .unit_cache import UnitCache

REGION = "experts"
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def is_moe(config: dict) -> bool:
    """Whether a config describes a mixture-of-experts model (its FFNs are expert blocks)."""
    return any(config.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts"))


def switch_paths(model: nn.Module) -> Dict[int, str]:
    """layer index -> module path of that layer's SwitchGLU (layers without experts are left out).

    Raises UnsupportedArchitectureError for expert blocks mlx_flash cannot stream (not a SwitchGLU)."""
    modules = dict(model.named_modules())
    paths = {}
    for i, layer in enumerate(model.layers):
        prefix = next(p for p, m in modules.items() if m is layer)
        found = [p for p, m in modules.items() if p.startswith(prefix + ".") and isinstance(m, SwitchGLU)]
        other = [p for p, m in modules.items() if p.startswith(prefix + ".") and type(m).__name__ in ("SwitchMLP",)]
        if other:
            raise UnsupportedArchitectureError(f"{other[0]}: expert blocks of type SwitchMLP are not supported (SwitchGLU only)")
        if len(found) > 1:
            raise UnsupportedArchitectureError(f"layer {i} has {len(found)} expert blocks; one per layer is supported")
        if found:
            paths[i] = found[0]
    if not paths:
        raise UnsupportedArchitectureError(f"{type(model).__module__}: no SwitchGLU expert block found")
    return paths


def expert_arrays(switch: nn.Module) -> Dict[str, mx.array]:
    """A SwitchGLU's parameters as unit components: 'gate_proj.weight' -> [n_experts, ...] (codes as stored)."""
    return dict(tree_flatten(switch.parameters()))


# MLX's quantisation modes whose codes and scales an expert unit keeps as they are (no biases but affine's):
# gpt-oss ships its experts in mxfp4
MODES = ("affine", "mxfp4", "mxfp8", "nvfp4")


def expert_quantization(switch: nn.Module) -> Dict[str, dict]:
    """projection -> {"bits", "group_size"[, "mode"]} of a quantised SwitchGLU, None for float projections
    ("mode" only when not affine)."""
    out = {}
    for name in PROJECTIONS:
        p = getattr(switch, name)
        mode = getattr(p, "mode", "affine")
        if mode not in MODES:
            raise UnsupportedArchitectureError(f"{name}: quantisation mode {mode!r} (one of {', '.join(MODES)})")
        if getattr(p, "global_scale", None) is not None:  # (nvfp4's optional global scale is not a unit's part)
            raise UnsupportedArchitectureError(f"{name}: quantisation with a global scale is not supported")
        out[name] = ({"bits": p.bits, "group_size": p.group_size, **({"mode": mode} if mode != "affine" else {})}
                     if hasattr(p, "bits") else None)
    return out


class Router:
    """An MoE model's selector as `--stats` reports it: the model's own router (resident, exact)."""

    name = "router (the model's own top-k: exact)"
    nbytes = 0


class FlashSwitchGLU(nn.Module):
    """Replaces a SwitchGLU: its experts come from the engine's cache of layer `layer`; its activation stays."""

    def __init__(self, engine: "ExpertEngine", layer: int, activation):
        super().__init__()
        self._engine, self._layer, self._activation = engine, layer, activation

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        return self._engine.experts(self._layer, x, indices, self._activation)


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
        router = next((r for r in (getattr(block, n, None) for n in ("gate", "router")) if isinstance(r, nn.Module)), None)
        if router is None or type(norm) is not nn.RMSNorm:
            return {}
        found[i] = (norm.weight.astype(mx.float32), router)
    order = sorted(found)
    out = {}
    for i, j in zip(order, order[1:]):
        w, w_next = found[i][0], found[j][0]
        out[i] = (j, mx.where(w == 0, 0.0, w_next / mx.where(w == 0, 1.0, w)), found[j][1])
    return out


class ReadAhead:
    """Reads ahead of need: while layer l's experts compute, the experts the next MoE layer's router picks for
    layer l's input (`next_routers`) are read into a staging area of their own: two buffers of `rows` experts, in
    the budget, which never evict the caches' working set. When that layer's real routing is known, its misses
    that were staged are copied into their cache rows (its overflow computed from the staging rows in place) and
    only the shortfall is read. The stats count routed experts that were predicted, bytes read ahead and bytes read
    ahead for nothing."""

    def __init__(self, engine: "ExpertEngine", routers: dict, top_k: int, rows: int):
        self.engine, self.routers, self.top_k = engine, routers, top_k
        stride = engine.layout.stride
        self.buffers = [AlignedBuffer(rows * stride, engine.fd.alignment) for _ in range(2)]
        self.views = [(b.rows(stride), b.host_rows(stride)) for b in self.buffers]
        mx.eval([v[0] for v in self.views])
        self.pending = None  # (layer, buffer, staged units, predicted units, wait)
        self.rows = self.host = None  # the buffer `take` gave out last
        self.next_buffer = 0

    @staticmethod
    def nbytes(fd, top_k: int) -> int:
        """DRAM of the staging area: two buffers of top_k experts (a decode step's routing of one layer)."""
        return 2 * top_k * fd.layouts[REGION].stride

    def predict(self, layer: int, x: mx.array):
        """The next layer's top-k experts for each row of this layer's expert input x [T, D] (lazy), or None."""
        if layer not in self.routers:
            return None
        _, scale, gate = self.routers[layer]
        logits = gate((x * scale).astype(x.dtype))
        if isinstance(logits, tuple):  # a router that picks itself (DeepSeek's grouped top-k): (indices, scores)
            return logits[0]
        return mx.argpartition(-logits, self.top_k - 1, axis=-1)[..., : self.top_k]

    def start(self, layer: int, predicted: np.ndarray):
        """Read the predicted experts of the layer after `layer` that its cache lacks (most-voted first, as many
        as a buffer holds) into the buffer `take` did not give out last."""
        self.drain()  # (a prediction nobody took: its buffer is about to be reused)
        target = self.routers[layer][0]
        ids, votes = np.unique(predicted, return_counts=True)
        cache = self.engine.caches[target]
        lacking = ~cache.contains(ids)
        missing = np.sort(ids[lacking][np.argsort(-votes[lacking], kind="stable")][: len(self.views[0][1])])
        b = self.next_buffer
        buf = self.buffers[b]
        wait = self.engine._submit(target, REGION, missing, buf.buffer,
                                   buf.base_offset + np.arange(len(missing), dtype=np.int64) * self.engine.layout.stride)
        self.engine.stats.current.ahead_bytes += len(missing) * self.engine.layout.stride
        self.pending = (target, b, missing, ids, wait)

    def take(self, layer: int, routed: np.ndarray) -> Dict[int, int]:
        """unit -> staging row of the experts read ahead for `layer` (waited for), and the prediction counted."""
        if self.pending is None or self.pending[0] != layer:
            return {}
        _, b, staged, predicted, wait = self.pending
        self.pending = None
        wait()
        s = self.engine.stats.current
        s.routed += len(routed)
        s.predicted += int(np.isin(routed, predicted).sum())
        s.ahead_wasted_bytes += int((~np.isin(staged, routed)).sum()) * self.engine.layout.stride
        self.rows, self.host = self.views[b]
        self.next_buffer = 1 - b
        return {int(u): r for r, u in enumerate(staged)}

    def row(self, r: int) -> np.ndarray:
        return self.host[r]

    def drain(self):
        """Wait for a read ahead still in flight (its rows are dropped)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending[-1]()


class ExpertEngine(Engine):
    """Owns the reader, the per-layer expert caches, the scratch buffer and the stats of an MoE model."""

    def __init__(self, fd, reader, capacity: List[Dict[str, int]], scratch_bytes: int, policy: str = "lru",
                 window: int = 5, compute_dtype=mx.float32):
        self.fd, self.reader = fd, reader
        self.layout = fd.layouts[REGION]
        self.components = {c.name: c for c in self.layout.components}
        self.quant = fd.ffn["quantization"]
        self.compute_dtype = compute_dtype
        self.stats = Stats([reader])
        self.sparsifier = Router()
        self.why = None
        self.route = None  # benchmarks: (layer, chosen experts) -> the experts to read instead (a replayed trace)
        self.read_ahead = None  # a ReadAhead: the next layer's predicted experts read while a layer computes
        self.caches: List[UnitCache] = [
            UnitCache(regions[REGION].n_units, capacity[i].get(REGION, 0), self.layout.stride, policy=policy,
                      window=window, alignment=fd.alignment) if REGION in regions else None
            for i, regions in enumerate(fd.layers)
        ]
        self.last_layer = max(i for i, c in enumerate(self.caches) if c is not None)
        self.scratch = AlignedBuffer(max(scratch_bytes, self.layout.stride), fd.alignment)
        self.row_layouts = {n: self._row_layout(n) for n, q in self.quant.items() if q is not None}

    @classmethod
    def from_plan(cls, fd, plan, reader, policy: str = "lru", window: int = 5, compute_dtype=mx.float32):
        engine = cls(fd, reader, plan.capacity, min(plan.workspace // 2, plan.scratch), policy, window, compute_dtype)
        engine.plan = plan
        return engine

    # -- compute -----------------------------------------------------------------
    def _matrices(self, row: mx.array, name: str):
        """(weight, scales, biases, bias) of projection `name` of the expert in `row` (views, no copy)."""
        parts = {}
        for part in ("weight", "scales", "biases", "bias"):
            c = self.components.get(f"{name}.{part}")
            parts[part] = None if c is None else mx.view(row[c.offset : c.offset + c.nbytes], getattr(mx, c.dtype)).reshape(c.shape)
        q = self.quant[name]
        if q is not None and q.get("symmetric"):
            parts["biases"] = cpu_gemv.symmetric_biases(parts["scales"], q["bits"])
        return parts

    def _project(self, x: mx.array, row: mx.array, name: str) -> mx.array:
        p, q = self._matrices(row, name), self.quant[name]
        if q is None:
            y = x @ p["weight"].astype(x.dtype).T
        elif "mode" in q:  # mxfp4 & co: MLX's own kernel on the codes and scales as stored
            y = mx.quantized_matmul(x, p["weight"], p["scales"], None, transpose=True, group_size=q["group_size"],
                                    bits=q["bits"], mode=q["mode"])
        else:
            y = cpu_gemv.quantized_matmul(x, p["weight"], p["scales"], p["biases"], q["group_size"], q["bits"])
        return y if p["bias"] is None else y + p["bias"].astype(y.dtype)

    def _row_layout(self, name: str) -> tuple:
        """QuantRows' fields of projection `name` within an expert's row: (offset, stride) of weight, scales and
        biases (symmetric: none stored, none read; the scales stand in), then n, bits, group size, dtype, symmetric."""
        q, c = self.quant[name], {p: self.components[f"{name}.{p}"] for p in ("weight", "scales")}
        c["biases"] = self.components.get(f"{name}.biases", c["scales"])
        at = [v for p in ("weight", "scales", "biases") for v in (c[p].offset, c[p].nbytes // c[p].shape[0])]
        return (*at, c["weight"].shape[-1] * 32 // q["bits"], q["bits"], q["group_size"], getattr(mx, c["scales"].dtype),
                bool(q.get("symmetric")))

    def _quant_rows(self, host: np.ndarray, slot: int, name: str) -> "cpu_gemv.QuantRows":
        """Projection `name` of the expert in row `slot` of `host` as the native kernels' rows (no copy, no view)."""
        w, ws, s, ss, b, bs, *rest = self.row_layouts[name]  # computed once: this runs 3 times per expert
        base = slot * host.shape[1]
        return cpu_gemv.QuantRows(host, base + w, ws, host, base + s, ss, host, base + b, bs, *rest)

    def _native(self, x: mx.array, activation) -> bool:
        """Rows the native kernels compute whole (a decode step, a verification pass, a short prompt: up to
        cpu_gemv.NATIVE_ROWS tokens): float32 on the CPU, quantised SwiGLU experts."""
        return (x.shape[0] <= cpu_gemv.NATIVE_ROWS and x.dtype == mx.float32 and cpu_gemv.available()
                and type(activation).__name__ == "SwiGLU" and all(q is not None and "mode" not in q for q in self.quant.values())
                and "gate_proj.bias" not in self.components)

    def _expert_row(self, xv: np.ndarray, host: np.ndarray, slot: int) -> np.ndarray:
        """`_expert` of float32 rows xv [m, D] on the native kernels, straight from the cache row: the expert's
        bytes are read once for all m."""
        g = cpu_gemv.row_dot(xv, self._quant_rows(host, slot, "gate_proj"), k=self.components["gate_proj.weight"].shape[0])
        u = cpu_gemv.row_dot(xv, self._quant_rows(host, slot, "up_proj"), k=g.shape[-1])
        cpu_gemv.silu_mul(g, u)
        return cpu_gemv.row_dot(g, self._quant_rows(host, slot, "down_proj"), k=self.components["down_proj.weight"].shape[0])

    def _expert(self, x: mx.array, row: mx.array, activation) -> mx.array:
        """One expert's output for the tokens x [n, D] that chose it (mlx-lm's SwitchGLU formula)."""
        h = activation(self._project(x, row, "up_proj"), self._project(x, row, "gate_proj"))
        return self._project(h, row, "down_proj")

    def experts(self, layer: int, x: mx.array, indices: mx.array, activation) -> mx.array:
        """SwitchGLU(x, indices): [..., k, D], each token's output of each expert it chose. After a failed read the
        layer's cache forgets what it admitted for it (rows never filled): later tokens never compute on unread bytes."""
        try:
            return self._experts(layer, x, indices, activation)
        except ReadError:
            self.caches[layer].reset(stats=False)
            if self.read_ahead is not None:
                self.read_ahead.pending = None  # (its reads were waited for or failed with this one)
            self.stats.forward_done()
            raise

    def _experts(self, layer: int, x: mx.array, indices: mx.array, activation) -> mx.array:
        shape, k = indices.shape, indices.shape[-1]
        self.stats.touch(prefill=indices.size > k)
        xf = x.reshape(-1, x.shape[-1]).astype(self.compute_dtype)
        ahead = self.read_ahead.predict(layer, xf) if self.read_ahead is not None else None
        mx.eval(indices, *([] if ahead is None else [ahead]))  # the layer's one synchronisation
        chosen = np.array(indices).reshape(-1)  # the router's choice
        if self.route is not None:
            chosen = self.route(layer, chosen)
        units, inverse = np.unique(chosen, return_inverse=True)
        cache = self.caches[layer]
        t = time.perf_counter()
        plan = cache.plan(units)
        s = self.stats.current
        s.mm_s += time.perf_counter() - t
        s.misses += len(plan.miss_units) + len(plan.overflow_units)
        s.hits += len(units) - len(plan.miss_units) - len(plan.overflow_units)
        s.active.append(len(units))
        staged = self.read_ahead.take(layer, units) if self.read_ahead is not None else {}
        miss_units, miss_slots = plan.miss_units, plan.miss_slots
        if staged:  # misses read ahead: copied into their cache rows, not read again
            t = time.perf_counter()
            done = np.array([u in staged for u in miss_units], dtype=bool)
            for u, slot in zip(miss_units[done], miss_slots[done]):
                cache.host[slot] = self.read_ahead.row(staged[u])
            miss_units, miss_slots = miss_units[~done], miss_slots[~done]
            s.mm_s += time.perf_counter() - t
        wait = self._submit(layer, REGION, miss_units, cache.buffer, cache.base_offset + miss_slots.astype(np.int64) * cache.row_bytes)
        if ahead is not None:  # the next layer's predicted experts go out now, while this one computes
            self.read_ahead.start(layer, np.array(ahead))
        native = self._native(xf, activation)
        if not native:  # MLX ops run lazily: the misses' rows must be in place before anything is built on them
            wait()
        outs, order = [], []
        xv = np.asarray(xf) if native else None

        def run(i, rows, host, slot):
            pos = np.flatnonzero(inverse == i)  # (token, choice) pairs routed to this expert
            if native:
                outs.append(self._expert_row(xv[pos // k], host, slot))
            else:
                tokens = pos // k
                xs = xf if len(tokens) == xf.shape[0] and np.array_equal(tokens, np.arange(len(tokens))) else xf[mx.array(tokens)]
                outs.append(self._expert(xs, rows[slot], activation))
            order.append(pos)

        cached = np.flatnonzero(plan.slots >= 0)
        reading = np.isin(units[cached], miss_units)
        for i in cached[~reading]:  # the hits (and what came from the staging area) while the misses are read
            run(i, cache.rows, cache.host, int(plan.slots[i]))
        wait()
        for i in cached[reading]:
            run(i, cache.rows, cache.host, int(plan.slots[i]))
        overflow = np.flatnonzero(plan.slots < 0)
        for i in [i for i in overflow if units[i] in staged]:  # more experts than slots, read ahead: in place
            run(i, self.read_ahead.rows, self.read_ahead.host, staged[units[i]])
        overflow = np.array([i for i in overflow if units[i] not in staged], dtype=np.int64)
        rows = self.scratch.rows(self.layout.stride)  # (the scratch holds at least one expert)
        per = len(rows)
        host = self.scratch.host_rows(self.layout.stride) if len(overflow) else None
        for start in range(0, len(overflow), per):  # more experts than slots: through the scratch, uncached
            if outs and not native:  # (native outputs are computed already)
                mx.eval(outs)  # what used the scratch rows before they are overwritten
            chunk = overflow[start : start + per]
            self._submit(layer, REGION, units[chunk], self.scratch.buffer,
                         self.scratch.base_offset + np.arange(len(chunk), dtype=np.int64) * self.layout.stride)()
            for j, i in enumerate(chunk):
                run(i, rows, host, j)
        if native:
            y = mx.array(np.concatenate(outs)[np.argsort(np.concatenate(order))])
        else:
            y = mx.concatenate(outs, axis=0)[mx.array(np.argsort(np.concatenate(order)))]
        if len(overflow):
            mx.eval(y)
        if layer == self.last_layer:
            self.stats.forward_done()
        return y.reshape(*shape, x.shape[-1]).astype(x.dtype)

    def ahead(self):
        return self.read_ahead

    def reset(self):
        if self.read_ahead is not None:
            self.read_ahead.drain()
        for c in self.caches:
            if c is not None:
                c.reset()
        self.stats.reset()
