"""Neurons as units: per decode step and layer, a selector picks the neurons a token needs; their sum is the FFN.

    x --backend.prepare--> the backend's form (a decode row on the CPU: numpy, the layer's one sync)
      --sparsifier--> active neurons --the unit step (units.py)--> partial sums per block of 256 neurons, added
      in block order: the FFN output (compute/: one backend per layout)

A neuron bundle holds what one hidden neuron needs: its gate and up columns and its down row (fc1 column and fc2 row
for non-GLU FFNs). Prompts (more than one token) read what sparsity.prompt_units gives them, the same way (the dip
layout streams each layer sequentially through the scratch buffer and seeds its caches instead); a pass over
several positions, sparsity.pass_units. Dense decoding reads the next layer's uncached units while a layer computes
(a full cache keeps the same units, so the overflow is the same every token).

Encoded layouts (bitmap-compressed pruned rows, flash format v2): every read goes through the scratch buffer as
encoded units and is expanded (BundleLayout.expand: MLX ops, or the Metal kernel on Apple silicon) into dense rows,
which fill the cache rows or are used directly. Cache rows are always dense, so compute is unchanged.
"""

import time
from functools import partial
from typing import Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..compute import cpu_gemv
from ..compute import rows as row_rules
from ..compute.backends import backend_for
from ..compute.ffn import glu, project
from ..compute.rows import RowSet, per_partial
from .cache import UnitCache
from .read_ahead import ReadAhead
from .sparsity import Dense, pass_units, prompt_units
from .units import REDUCTION_UNITS, Engine


class FlashFFN(nn.Module):
    """Replaces `layers[i].mlp`: the FFN of layer i computed from streamed units. Its engine and bias are not
    parameters (underscored): the weights are the engine's, read from flash."""

    def __init__(self, engine: "NeuronEngine", layer: int, bias: Dict[str, mx.array]):
        super().__init__()
        self._engine, self._layer, self._bias = engine, layer, bias

    def __call__(self, x: mx.array) -> mx.array:
        return self._engine.ffn(self._layer, x, self._bias)

    def ffn_row(self, x: np.ndarray, prefill: bool = False) -> np.ndarray:
        """The FFN of host rows x (float32 [d] or [m, d]) on the native CPU backend (native_step.py)."""
        return self._engine.ffn_row(self._layer, x, self._bias, prefill)

    def serve_from(self, engine: "NeuronEngine"):
        """Compute from `engine` from now on (NeuronEngine.attach)."""
        self._engine = engine
        if "fc1" in self._bias and hasattr(engine.sparsifier, "bias"):  # the ReLU oracle needs fc1's bias
            engine.sparsifier.bias[self._layer] = self._bias["fc1"]


class NeuronEngine(Engine):
    """The engine of a dense model's FFN neurons: its sparsifier (which neurons a token needs) and one compute
    backend per region layout, over the unit step's caches, reads and scratch buffer."""

    def __init__(
        self,
        fd,
        reader,
        sparsifier,
        capacity: List[Dict[str, int]],
        scratch_bytes: int,
        policy: str = "window",
        window: int = 5,
        compute_dtype=mx.float32,
        use_metal=None,
        prefetch_rows: int = 0,
    ):
        self.sparsifier = sparsifier
        self.info = fd.ffn
        self.dip_layout = fd.ffn.get("layout") == "dip"
        self.window = window
        self.compute_dtype = compute_dtype
        self.use_metal = use_metal
        self.why = None  # why load's --sparsity auto chose this sparsifier
        self.budget_note = None  # what load's --memory-budget auto found and chose
        caches = [
            {
                name: UnitCache(
                    r.n_units,
                    capacity[i][name],
                    fd.layouts[name].stride,
                    policy=policy,
                    window=window,
                    alignment=fd.unit_alignment,  # packed rows: scattered reads bounce
                    compact=False,  # the backends read rows by slot: no row moves on eviction
                )
                for name, r in regions.items()
            }
            for i, regions in enumerate(fd.layers)
        ]
        block = max(min(REDUCTION_UNITS, r.n_units) * fd.layouts[r.name].stride for r in fd.regions())
        super().__init__(fd, reader, caches, max(scratch_bytes, block + 2 * fd.alignment))  # >= a block's rows
        self.backends = {name: backend_for(layout, fd.ffn, use_metal) for name, layout in fd.layouts.items()}
        self.read_ahead = ReadAhead(self, "neurons", prefetch_rows) if prefetch_rows else None

    @classmethod
    def from_plan(
        cls,
        fd,
        plan,
        reader,
        sparsifier,
        policy: str = "window",
        window: int = 5,
        use_metal=None,
        compute_dtype=mx.float32,
    ) -> "NeuronEngine":
        """The engine a budget plan (budget.plan_memory) describes: its caches, scratch and read-ahead buffers; for
        load and the bench alike."""
        engine = cls(
            fd,
            reader,
            sparsifier,
            plan.capacity,
            min(plan.workspace // 2, plan.scratch),
            policy,
            window,
            compute_dtype=compute_dtype,
            use_metal=use_metal,
            prefetch_rows=plan.prefetch_rows,
        )
        engine.plan = plan
        return engine

    # -- I/O -------------------------------------------------------------------
    def read_into_slots(self, layer, region, units, slots):
        if not self.fd.layouts[region].encoded:  # straight into the cache rows, waited for later
            return super().read_into_slots(layer, region, units, slots)
        cache = self.caches[layer][region]
        for pos, rows in self._chunks(layer, region, units):  # encoded: read and expanded now
            t = time.perf_counter()
            cache.host[slots[pos]] = np.asarray(rows)
            self.stats.current.mm_s += time.perf_counter() - t
        return lambda: None

    def _chunks(self, layer: int, region: str, units: np.ndarray):
        """Yield (positions, dense rows [len, stride] mx.array) for `units` read through the scratch buffer, a
        chunk at a time (`_read_chunks`)."""
        per = self._per_chunk(region)
        starts = range(0, len(units), per)
        for start, rows in zip(starts, self._read_chunks(layer, region, [units[s : s + per] for s in starts])):
            yield np.arange(start, start + len(rows)), rows

    def _stream(self, layer: int, region: str, units: np.ndarray):
        """`_chunks`, and units that are in the region's cache (e.g. just seeded by a prompt) get
        their cache row refreshed from the streamed rows: no second read."""
        cache = self.caches[layer][region]
        for positions, rows in self._chunks(layer, region, units):
            yield positions, rows
            chunk = units[positions]
            slots = cache.unit_to_slot[chunk]
            keep = slots >= 0
            if keep.any():
                t = time.perf_counter()
                cache.host[slots[keep]] = np.asarray(rows)[keep]
                self.stats.current.mm_s += time.perf_counter() - t

    def ffn(self, layer: int, x: mx.array, bias: Dict[str, mx.array]) -> mx.array:
        B, L, _ = x.shape
        xc = x.astype(self.compute_dtype)
        backend = self.backends["neurons"]
        lengths = row_rules.segments()
        if B * L > 1 and not (lengths is not None and max(lengths) == 1):  # (several sequences' decode steps: decode)
            y = self.guarded(layer, True, lambda: self._prefill(layer, xc, bias))
        else:  # on the CPU, prepare gives the host row (evaluating everything before this FFN)
            y = self.guarded(layer, False, lambda: backend.finish(self._step(layer, self._input(xc), bias), xc))
        if "fc2" in bias:
            y = y + bias["fc2"].astype(y.dtype)
        return y.astype(x.dtype)

    def ffn_row(self, layer: int, x: np.ndarray, bias: Dict[str, mx.array], prefill: bool = False) -> np.ndarray:
        """`ffn` of a decode step's host rows x (float32 [d], or [m, d]: the positions of a verification pass or a
        prompt chunk) on the native CPU backend: the entry of native_step.HostDecoder, whose layers never leave the
        host."""
        y = self.guarded(layer, prefill, lambda: self._step(layer, x, bias))
        return y + np.asarray(bias["fc2"], dtype=np.float32) if "fc2" in bias else y

    def _input(self, x: mx.array):
        return self.backends["inputs" if self.dip_layout else "neurons"].prepare(x)

    def _step(self, layer: int, xb, bias):
        """A decode step's FFN of the layer input xb (in the backend's form), in that form. Several rows (the
        positions of a verification pass, on the host) read the union of their units once; each row is computed
        over its own units only, as a decode step of it alone would be."""
        backend = self.backends["inputs" if self.dip_layout else "neurons"]
        # what the selector reads (MLX's lazy rows evaluated: the layer's one synchronisation); dense reads nothing
        rows = None if isinstance(self.sparsifier, Dense) and not self.dip_layout else backend.host(xb)
        self.stats.current.syncs += rows is not None and not isinstance(xb, np.ndarray)
        if self.dip_layout:
            if len(rows) > 1:
                raise ValueError("the dip layout decodes one position at a time")
            return self._decode_dip(layer, rows[0], xb)
        return self._decode(layer, rows, xb, bias)

    def _decode(self, layer, rows, x, bias):
        if (
            isinstance(x, np.ndarray)
            and x.size == x.shape[-1]
            and isinstance(self.sparsifier, Dense)
            and self.read_ahead is None
        ):
            y = self._decode_whole(layer, x, bias)
            if y is not None:
                return y
        cached = self._cached_mask(layer, "neurons")
        if rows is None:  # dense: every unit, for every row
            active, mask = self.sparsifier.select(layer, None), None
        else:
            active, mask = pass_units([self.sparsifier.select(layer, v, cached) for v in rows])
        self.stats.current.active.append(len(active))
        return self._sum(
            layer, "neurons", active, self._units_fn(x, active, bias, mask), self.backends["neurons"].zeros(x)
        )

    def _decode_whole(self, layer, x, bias) -> Optional[np.ndarray]:
        """A dense layer's decode step on host rows where its cache holds every unit: the calls `_sum` makes there
        (every unit in place, its partial sums in block order), without the unit step's bookkeeping. None where the
        cache does not hold the layer."""
        cache = self.caches[layer]["neurons"]
        plan = cache.plan_whole()
        if plan is None:
            return None
        active = self.sparsifier.select(layer, x)
        s = self.stats.current
        s.active.append(len(active))
        s.hits += len(active)
        bound = cache.whole_call  # (bound to the cache's rows: freed with them)
        if bound is None or bound[0] is not active or bound[1] is not bias:
            blocks = self._blocks(active, REDUCTION_UNITS)
            pos, dst = blocks.everything()
            call = self.backends["neurons"].bind_units(cache.rows, plan.slots, active[pos], bias, dst, len(blocks))
            cache.whole_call = bound = (active, bias, call)
        return cpu_gemv.sum_rows(bound[2](x))

    def _sum(self, layer: int, region: str, active: np.ndarray, fn, zero):
        """The sum over the active units (sorted) of fn's terms (units.Engine.step's fn), in one order whatever the
        budget, cache state or read-ahead: the step's partial sums of blocks of REDUCTION_UNITS ids, added in block
        order; `zero` when there are none."""
        backend = self.backends[region]
        # gathered rows (MLX ops) are bounded by the workspace; host rows are read in place, all in one call
        per = None if isinstance(zero, np.ndarray) else self.gathered_units(region)
        read_next = partial(self.read_overflow, layer, "neurons")
        parts = self.step(layer, region, active, fn, backend.sync, per=per, read_next=read_next)
        if not len(parts):
            return zero
        if isinstance(zero, np.ndarray) and parts[0].ndim == zero.ndim:  # (one call's, folded as it made them)
            return parts[0]
        if isinstance(parts[0], np.ndarray):  # the partial sums in block order, added in that order
            total = cpu_gemv.sum_rows(parts[0])
            for part in parts[1:]:  # (in place: a prompt chunk's partial sums are [blocks, positions, d] already)
                for row in part:
                    total += row  # (sum_rows' own arithmetic)
            return total
        return (mx.concatenate(parts) if len(parts) > 1 else parts[0]).sum(axis=0)  # (one op, whatever the calls)

    def _units_fn(self, x, active, bias, mask=None):
        """fn for `_sum`: the FFN of x restricted to those units (mask [rows, active]: which of them each row of
        x uses). A call of several host rows over every block (`fold`, Engine.step) where it is one fused call:
        their sum, each partial sum added as it ends (cpu_gemv.FfnGlu)."""
        backend = self.backends["neurons"]
        folds = isinstance(x, np.ndarray) and x.size > x.shape[-1] and mask is None
        folds = folds and getattr(backend, "fused", bool)()

        def fn(rows, slots, pos, dst, n, fold=False):
            if fold:
                return backend.bind_units(rows, slots, active[pos], bias, dst, n)(x, fold=True)
            return backend.units(x, rows, slots, active[pos], bias, None if mask is None else mask[:, pos], dst, n)

        fn.folds = folds
        return fn

    @staticmethod
    def _blockwise(backend, like, f):
        """fn for `_sum` from f(rows, slots, positions), one call per block."""

        def fn(rows, slots, pos, dst, n):
            if isinstance(rows, RowSet) and not backend.in_place(like):
                rows, slots = rows.gather(), np.arange(len(rows))
            return per_partial(rows, slots, dst, n, lambda r, s, sel: f(r, s, pos[sel]))

        return fn

    def _decode_dip(self, layer, xv, x):
        dip, b_in, b_out = self.sparsifier, self.backends["inputs"], self.backends["neurons"]
        # 1. gate/up from the input columns with the largest |x| (cache-aware if gamma < 1)
        inputs = dip.select_inputs(layer, xv, self._cached_mask(layer, "inputs"))
        x_in = b_in.index(x, inputs)
        gu = self._sum(
            layer,
            "inputs",
            inputs,  # (never empty: DIP keeps at least one input)
            self._blockwise(b_in, x, lambda rows, slots, pos: b_in.input_columns(b_in.index(x_in, pos), rows, slots)),
            None,
        )
        h = b_in.glu(gu[0], gu[1])
        # 2. down rows of the largest pruned GLU outputs
        neurons = dip.select_neurons(layer, b_in.host(h)[0], self._cached_mask(layer, "neurons"))
        self.stats.current.active.append(len(inputs) + len(neurons))
        h_out = b_out.index(h, neurons)
        return self._sum(
            layer,
            "neurons",
            neurons,
            self._blockwise(
                b_out, x, lambda rows, slots, pos: b_out.row_axpy(b_out.index(h_out, pos), rows, slots, "down")
            ),
            b_out.zeros(x),
        )

    def _cached_mask(self, layer: int, region: str) -> Optional[np.ndarray]:
        gamma = getattr(self.sparsifier, "gamma", 1.0)
        return self.caches[layer][region].cached_mask() if gamma != 1.0 else None

    # -- prefill -----------------------------------------------------------------
    def _prefill(self, layer: int, x: mx.array, bias: Dict[str, mx.array]) -> mx.array:
        """The FFN over a prompt from the units sparsity.prompt_units gives all of its tokens, read like one decode
        step: cached units in place, the misses into the cache, the overflow streamed (or read ahead)."""
        if self.dip_layout:
            return self._prefill_dip(layer, x)
        n = self.fd.layers[layer]["neurons"].n_units
        backend = self.backends["neurons"]
        t = time.perf_counter()
        units = prompt_units(self.sparsifier, layer, lambda: backend.host(x), n)
        self.stats.current.mm_s += time.perf_counter() - t
        return self._sum(layer, "neurons", units, self._units_fn(x, units, bias), backend.zeros(x))

    def _prefill_dip(self, layer: int, x: mx.array) -> mx.array:
        """Dense FFN over a prompt in the dip layout, the layer streamed sequentially; the caches are seeded on the
        way."""
        self._seed(layer, x)
        info = self.info
        g = u = 0
        for pos, rows in self._stream_all(layer, "inputs"):
            a = self.fd.layouts["inputs"].unpack(rows)
            xs = x[..., int(pos[0]) : int(pos[-1]) + 1]
            g, u = (
                g + project(xs, a, "gate", info["matrices"]["gate"]),
                u + project(xs, a, "up", info["matrices"]["up"]),
            )
            mx.eval(g, u)
        h = glu(g, u, info["activation"])
        y = 0
        for pos, rows in self._stream_all(layer, "neurons"):
            a = self.fd.layouts["neurons"].unpack(rows)
            part = project(h[..., int(pos[0]) : int(pos[-1]) + 1], a, "down", info["matrices"]["down"])
            mx.eval(part)
            y = y + part
        return y

    def _stream_all(self, layer, region):
        return self._stream(layer, region, np.arange(self.fd.layers[layer][region].n_units, dtype=np.int32))

    def _seed(self, layer, x):
        """Admit the input columns of the last `window` prompt tokens (rows are filled while streaming;
        down needs the GLU, so only inputs)."""
        last = np.array(x.reshape(-1, x.shape[-1])[-self.window :].astype(mx.float32))
        t = time.perf_counter()
        for v in last:
            self.caches[layer]["inputs"].plan(self.sparsifier.select_inputs(layer, v))
        self.stats.current.mm_s += time.perf_counter() - t

    def attach(self, model) -> "NeuronEngine":
        """Serve every FlashFFN of `model` from this engine (e.g. a fresh one with another sparsifier,
        budget or reader) and set `model.flash`; returns the engine it replaced (None if none).
        The streamer of resident weights (resident.py), if any, moves to this engine. The caller
        frees or closes the old one: several engines may share a reader."""
        old = getattr(model, "flash", None)
        if old is not None and old is not self and old.streamer is not None:
            # the model's streamed attention/embedding modules read through it: it moves along
            self.use_streamer(old.streamer)
            old.streamer = None
        for layer in model.layers:
            layer.mlp.serve_from(self)
        model.flash = self
        return old
