"""The flash runtime: per decode step and layer, choose units, fetch misses, compute the FFN.

    x --backend.prepare--> the backend's form (a decode row on the CPU: numpy, the layer's one sync)
      --sparsifier--> active units --UnitCache.plan--> hits + misses
      misses --reader (pread pool)--> cache rows;  overflow --reader--> scratch, used uncached
      cache rows + x --backend.units--> FFN output (compute/: one backend per layout)

Prompts (more than one token) read what sparsity.prompt_units gives them, the same
way (the dip layout streams each layer sequentially through the scratch buffer and
seeds its caches instead); a pass over several positions, sparsity.pass_units.
Dense decoding reads the next layer's uncached units while a layer computes (Prefetch).

Encoded layouts (bitmap-compressed pruned rows, flash_format v2): every read goes
through the scratch buffer as encoded units and is expanded (BundleLayout.expand:
MLX ops, or the Metal kernel on Apple silicon) into dense rows, which fill the cache
rows or are used directly. Cache rows are always dense, so compute is unchanged.
"""

import math
import time
from typing import Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .errors import ReadError
from .compute import backend_for
from .compute.rows import RowSet, per_partial
from .ffn import glu, project
from .unit_cache import UnitCache
from .reader import aligned_buffer, aligned_span
from .sparsity import pass_units, prompt_units
from .stats import Stats

# Units summed together in one call before partial sums are added, in this order (a multiple of every group size):
# the reduction over units is the same whatever the budget, cache state or read-ahead.
REDUCTION_UNITS = 256


class Blocks:
    """The active units (sorted ids) cut into the fixed reduction blocks: block b is positions
    starts[b] : starts[b] + sizes[b] of them."""

    def __init__(self, active: np.ndarray):
        ids = active // REDUCTION_UNITS
        self.starts = np.flatnonzero(np.diff(ids, prepend=-1))
        self.sizes = np.diff(self.starts, append=len(active))

    def __len__(self):
        return len(self.starts)

    def select(self, run: list):
        """(positions, dst int32: their block's index in the run) of a run of consecutive blocks."""
        lo, hi = self.starts[run[0]], self.starts[run[-1]] + self.sizes[run[-1]]
        return np.arange(lo, hi), np.repeat(np.arange(len(run), dtype=np.int32), self.sizes[run[0] : run[-1] + 1])


class FlashFFN(nn.Module):
    """Replaces `layers[i].mlp`: the FFN of layer i computed from streamed units."""

    def __init__(self, engine: "FlashEngine", layer: int, bias: Dict[str, mx.array]):
        super().__init__()
        self._engine, self._layer, self._bias = engine, layer, bias

    def __call__(self, x: mx.array) -> mx.array:
        return self._engine.ffn(self._layer, x, self._bias)


class Engine:
    """What the engines of neurons (FlashEngine) and of experts (experts.ExpertEngine) share: a reader and its stats
    (reads of units submitted, the time waited for them counted as I/O), the streamer of resident weights, and
    reads ahead (`ahead()`) to wait for before the files close."""

    streamer = None  # offload.ResidentStreamer when resident weights are streamed too

    def ahead(self):
        """The reads ahead of need in flight (a Prefetch / ReadAhead), or None."""
        return None

    def use_streamer(self, streamer):
        """Resident weights are streamed through `streamer` (offload.ResidentStreamer): its reads count here."""
        self.streamer, streamer.stats = streamer, self.stats
        self.stats.readers.append(streamer.reader)

    def _submit(self, layer: int, region: str, units: np.ndarray, buffer: mx.array, dest: np.ndarray):
        """Start reading `units` of a region to byte offsets `dest` of `buffer` (one batch; the pool
        coalesces); returns a function that waits for it, counting the time waited as I/O."""
        if len(units) == 0:
            return lambda: None
        r = self.fd.layers[layer][region]
        return self._submit_ranges(buffer, r.unit_offsets(units), np.full(len(units), r.stride, dtype=np.int64), dest)

    def _submit_ranges(self, buffer, offsets: np.ndarray, lengths: np.ndarray, dest: np.ndarray, requested=None):
        """The reads of `_submit` (any byte ranges); `requested`: the units' bytes among them (default all: the
        alignment a run's superset adds is counted at the device, not as asked)."""
        t = time.perf_counter()
        handle = self.reader.submit(buffer, offsets.astype(np.int64), lengths.astype(np.int64), dest.astype(np.int64))
        s = self.stats.current
        s.io_s += time.perf_counter() - t
        s.bytes_requested += int(lengths.sum()) if requested is None else requested

        def wait():
            t = time.perf_counter()
            self.reader.wait(handle)
            self.stats.current.io_s += time.perf_counter() - t

        return wait

    def close(self):
        """Release the readers' files and threads (a read ahead that failed raises, after they are released)."""
        try:
            if self.ahead() is not None:
                self.ahead().drain()
        finally:
            self.reader.close()
            if self.streamer is not None:
                self.streamer.close()


class FlashEngine(Engine):
    """Owns the reader, the per-layer caches, the scratch buffer, the sparsifier and the stats."""

    def __init__(self, fd, reader, sparsifier, capacity: List[Dict[str, int]], scratch_bytes: int,
                 policy: str = "window", window: int = 5, compute_dtype=mx.float32, use_metal=None,
                 prefetch_rows: int = 0):
        self.fd, self.reader, self.sparsifier = fd, reader, sparsifier
        self.info = fd.ffn
        self.dip_layout = fd.ffn.get("layout") == "dip"
        self.window = window
        self.compute_dtype = compute_dtype
        self.use_metal = use_metal
        self.stats = Stats([reader])
        self.why = None  # why load's --sparsity auto chose this sparsifier
        self.overlap = True  # compute cached hits while misses are read (False: wait first; for A/B runs)
        self.caches: List[Dict[str, UnitCache]] = [
            {
                name: UnitCache(r.n_units, capacity[i][name], fd.layouts[name].stride, policy=policy, window=window,
                                alignment=fd.unit_alignment)  # packed rows: scattered reads bounce
                for name, r in regions.items()
            }
            for i, regions in enumerate(fd.layers)
        ]
        self.backends = {name: backend_for(layout, fd.ffn, use_metal) for name, layout in fd.layouts.items()}
        block = max(min(REDUCTION_UNITS, r.n_units) * fd.layouts[r.name].stride for r in fd.regions())
        self.scratch = AlignedBuffer(max(scratch_bytes, block + 2 * fd.alignment), fd.alignment)  # >= a block's rows
        self.prefetch = Prefetch(self, prefetch_rows) if prefetch_rows else None

    @classmethod
    def from_plan(cls, fd, plan, reader, sparsifier, policy: str = "window", window: int = 5, use_metal=None,
                  compute_dtype=mx.float32) -> "FlashEngine":
        """The engine a budget plan (budget.plan_memory) describes: its caches, scratch and read-ahead buffers; for
        load and the bench alike."""
        engine = cls(fd, reader, sparsifier, plan.capacity, min(plan.workspace // 2, plan.scratch), policy, window,
                     compute_dtype=compute_dtype, use_metal=use_metal, prefetch_rows=plan.prefetch_rows)
        engine.plan = plan
        return engine

    # -- I/O -------------------------------------------------------------------
    def _submit_run(self, layer: int, region: str, first: int, n: int, buffer: mx.array, base: int):
        """Start reading units first..first+n-1, neighbours on flash, as the aligned superset of their bytes into
        `buffer` at byte `base` (aligned, with room for n strides and two alignments): one direct read, where
        packed units read one by one would go through the pool's bounce buffers. Returns (wait, the byte offset
        of the first unit in `buffer`)."""
        r = self.fd.layers[layer][region]
        lo = r.unit_offset(first)
        start, end = aligned_span(lo, n * r.stride, max(1, self.reader.alignment))
        wait = self._submit_ranges(buffer, np.array([start]), np.array([end - start]), np.array([base]), n * r.stride)
        return wait, base + lo - start

    def _read(self, layer: int, region: str, units: np.ndarray, buffer: mx.array, dest: np.ndarray) -> None:
        self._submit(layer, region, units, buffer, dest)()

    def _read_into_cache(self, layer, region, units, slots):
        """Start reading misses into their cache rows; returns the function that waits for them."""
        cache = self.caches[layer][region]
        if not self.fd.layouts[region].encoded:  # straight into the cache rows, waited for later
            return self._submit(layer, region, units, cache.buffer, cache.base_offset + slots.astype(np.int64) * cache.row_bytes)
        for pos, rows in self._chunks(layer, region, units):  # encoded: read and expanded now
            t = time.perf_counter()
            cache.host[slots[pos]] = np.asarray(rows)
            self.stats.current.mm_s += time.perf_counter() - t
        return lambda: None

    def _chunks(self, layer: int, region: str, units: np.ndarray):
        """Yield (positions, dense rows [len, stride] mx.array) for `units` read through the scratch buffer, a
        chunk at a time (`_read_chunk`)."""
        per = self._per_chunk(region)
        for start in range(0, len(units), per):
            chunk = units[start : start + per]
            yield np.arange(start, start + len(chunk)), self._read_chunk(layer, region, chunk)

    def _read_chunk(self, layer: int, region: str, chunk: np.ndarray) -> mx.array:
        """Dense rows [len, stride] of `chunk` (at most `_fits` units) read through the scratch buffer.

        Dense layouts give views of the scratch buffer, overwritten by the next chunk: evaluate
        what uses them first. Encoded units are expanded (evaluated) into new arrays (chunks are
        sized so that those stay within the scratch size too)."""
        layout = self.fd.layouts[region]
        disk, slack = layout.disk_stride, 2 * max(1, self.reader.alignment)
        if chunk[-1] - chunk[0] == len(chunk) - 1 and len(chunk) * disk + slack <= self.scratch.nbytes:
            wait, at = self._submit_run(layer, region, int(chunk[0]), len(chunk), self.scratch.buffer,
                                        self.scratch.base_offset)  # a run on flash: one aligned read
            wait()
            out = self.scratch.buffer[at : at + len(chunk) * disk].reshape(len(chunk), disk)
        else:
            dest = self.scratch.base_offset + np.arange(len(chunk), dtype=np.int64) * disk
            self._read(layer, region, chunk, self.scratch.buffer, dest)
            out = self.scratch.rows(disk)[: len(chunk)]
        if layout.encoded:
            t = time.perf_counter()
            out = layout.expand(out, self.use_metal)
            self.stats.current.expand_s += time.perf_counter() - t
        mx.eval(out)  # (a view now: native kernels read it by address)
        return out

    def _per_chunk(self, region: str) -> int:
        """Units `_chunks` reads through the scratch buffer at a time: whole aligned blocks of them where the
        scratch holds some (no block read twice by neighbouring runs)."""
        layout = self.fd.layouts[region]
        a = max(1, self.reader.alignment)
        step = a // math.gcd(layout.disk_stride, a)
        fits = self._fits(region)
        return fits // step * step if fits >= step else fits

    def _fits(self, region: str) -> int:
        """Units `_read_chunk` takes at a time."""
        return max(1, (self.scratch.nbytes - 2 * max(1, self.reader.alignment)) // self.fd.layouts[region].stride)

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

    def _fetch(self, layer: int, region: str, active: np.ndarray):
        """Plan the cache for `active` and start reading its misses; overflow is left to `_sum_over`.
        Returns the plan and a function that waits for the misses."""
        cache = self.caches[layer][region]
        t = time.perf_counter()
        plan = cache.plan(active)
        s = self.stats.current
        s.mm_s += time.perf_counter() - t
        wait = self._read_into_cache(layer, region, plan.miss_units, plan.miss_slots)
        s.misses += len(plan.miss_units) + len(plan.overflow_units)
        s.hits += len(active) - len(plan.miss_units) - len(plan.overflow_units)
        return plan, wait

    def _sum_over(self, layer: int, region: str, active: np.ndarray, fn, zero):
        """The sum over the active units (sorted) of fn's terms, in one order whatever the budget, cache state or
        read-ahead: the units are cut into fixed blocks of REDUCTION_UNITS consecutive ids, each block's partial sum
        is computed from all of its rows in one call, and the partials are added in block order; `zero` when there
        are none.

        fn(rows, slots, positions, dst, n) returns the n partial sums of the blocks of `positions` (into `active`;
        block i: those with dst == i), rows[slots] their rows, or a RowSet (slots None) where they lie in several
        buffers. Blocks whose units are all cached are computed while the misses are read (I/O overlapped with
        compute: the native kernels run eagerly, the MLX backends when synchronised), then those with misses, then
        those with overflow: rows read ahead, the rest streamed through the scratch buffer a chunk of whole blocks
        at a time.
        """
        backend = self.backends[region]
        plan, wait = self._fetch(layer, region, active)
        if not self.overlap or not len(active):
            wait()
        if not len(active):
            return zero
        cache = self.caches[layer][region]
        blocks = Blocks(active)
        over = plan.slots < 0
        reading = np.zeros(len(active), dtype=np.int8)
        reading[~over] = np.isin(active[~over], plan.miss_units)
        kind = np.maximum.reduceat(over * 2 + reading, blocks.starts)  # per block: 0 all hits, 1 misses, 2 overflow
        parts = [None] * len(blocks)
        per = self._fits(region)  # (MLX ops gather a group's rows: at most a scratch buffer's worth)

        def compute(todo):
            groups = self._groups(todo, blocks.sizes, per)
            for group in groups:
                pos, dst = blocks.select(group)
                out = fn(cache.rows, plan.slots[pos], pos, dst, len(group))
                if len(groups) > 1:
                    backend.sync(out)  # one group's gathered rows (MLX ops) alive at a time
                parts[group[0] : group[-1] + 1] = out

        compute(np.flatnonzero(kind == 0))
        wait()  # before anything reads the misses' rows
        compute(np.flatnonzero(kind == 1))
        if (kind == 2).any():
            self._overflow(layer, region, active, plan, np.flatnonzero(kind == 2), blocks, parts, fn)
        y = parts[0]
        for part in parts[1:]:
            y = y + part
        return y

    def _overflow(self, layer, region, active, plan, todo, blocks, parts, fn):
        """`_sum_over`'s blocks with overflow units: the first ones read ahead (Prefetch), the rest streamed; each
        call holds whole blocks, their cached rows read in place beside the others (a RowSet)."""
        backend, cache = self.backends[region], self.caches[layer][region]
        overflow = np.flatnonzero(plan.slots < 0)
        where = np.zeros(len(active), dtype=np.int64)  # 0: cache row, 1: read ahead, 2: scratch
        index = plan.slots.astype(np.int64)
        ahead = self.prefetch.take(layer, active[overflow]) if self.prefetch else None
        k = 0 if ahead is None else len(ahead)
        where[overflow[:k]], index[overflow[:k]] = 1, np.arange(k)
        where[overflow[k:]] = 2
        streamed = np.add.reduceat(where == 2, blocks.starts)
        for group in self._groups(todo, streamed, self._fits(region)):
            pos, dst = blocks.select(group)
            mine = pos[where[pos] == 2]
            scratch = cache.rows
            if len(mine):
                scratch = self._read_chunk(layer, region, active[mine])
                index[mine] = np.arange(len(mine))
            rows = RowSet([cache.rows, cache.rows if ahead is None else ahead, scratch], where[pos], index[pos])
            out = fn(*rows.single(), pos, dst, len(group))
            backend.sync(out)  # before the next chunk overwrites the scratch rows
            parts[group[0] : group[-1] + 1] = out

    @staticmethod
    def _groups(todo, weight, per):
        """The blocks `todo` in runs of consecutive blocks whose weights add up to at most `per` (a block alone may
        exceed it)."""
        groups, group, total = [], [], 0
        for b in todo.tolist():
            if group and (total + weight[b] > per or b != group[-1] + 1):
                groups.append(group)
                group, total = [], 0
            group.append(b)
            total += weight[b]
        if group:
            groups.append(group)
        return groups

    # -- FFN -------------------------------------------------------------------
    def ffn(self, layer: int, x: mx.array, bias: Dict[str, mx.array]) -> mx.array:
        B, L, _ = x.shape
        xc = x.astype(self.compute_dtype)
        backend = self.backends["neurons"]
        if B * L > 1:
            y = self._guarded(layer, True, lambda: self._prefill(layer, xc, bias))
        else:  # on the CPU, prepare gives the host row (evaluating everything before this FFN)
            y = self._guarded(layer, False, lambda: backend.finish(self._step(layer, self._input(xc), bias), xc))
        if "fc2" in bias:
            y = y + bias["fc2"].astype(y.dtype)
        return y.astype(x.dtype)

    def ffn_row(self, layer: int, x: np.ndarray, bias: Dict[str, mx.array], prefill: bool = False) -> np.ndarray:
        """`ffn` of a decode step's host rows x (float32 [d], or [m, d]: the positions of a verification pass or a
        prompt chunk) on the native CPU backend: the entry of decode.HostDecoder, whose layers never leave the host."""
        y = self._guarded(layer, prefill, lambda: self._step(layer, x, bias))
        return y + np.asarray(bias["fc2"], dtype=np.float32) if "fc2" in bias else y

    def _input(self, x: mx.array):
        return self.backends["inputs" if self.dip_layout else "neurons"].prepare(x)

    def _step(self, layer: int, xb, bias):
        """A decode step's FFN of the layer input xb (in the backend's form), in that form. Several rows (the
        positions of a verification pass, on the host) read the union of their units once; each row is computed
        over its own units only, as a decode step of it alone would be."""
        backend = self.backends["inputs" if self.dip_layout else "neurons"]
        rows = backend.host(xb)  # what the selector reads
        if self.prefetch is not None:  # the next layer's (next token's, after the last) reads go out now
            self.prefetch.start((layer + 1) % len(self.caches))
        if self.dip_layout:
            if len(rows) > 1:
                raise ValueError("the dip layout decodes one position at a time")
            return self._decode_dip(layer, rows[0], xb)
        return self._decode(layer, rows, xb, bias)

    def _guarded(self, layer: int, prefill: bool, compute):
        """compute() as layer `layer`'s FFN of a forward pass: its stats, and after a failed read the layer's
        caches forget the units admitted for it (rows never filled), so later tokens never compute on unread bytes."""
        self.stats.touch(prefill=prefill)
        try:
            y = compute()
        except ReadError:
            for cache in self.caches[layer].values():
                cache.reset(stats=False)
            if self.prefetch is not None:
                self.prefetch.drain()
            self.stats.forward_done()
            raise
        if layer == len(self.caches) - 1:
            self.stats.forward_done()
        return y

    def _decode(self, layer, rows, x, bias):
        cached = self._cached_mask(layer, "neurons")
        active, mask = pass_units([self.sparsifier.select(layer, v, cached) for v in rows])
        self.stats.current.active.append(len(active))
        return self._sum_over(layer, "neurons", active, self._units_fn(x, active, bias, mask),
                              self.backends["neurons"].zeros(x))

    def _units_fn(self, x, active, bias, mask=None):
        """fn for `_sum_over`: the FFN of x restricted to those units (mask [rows, active]: which of them each row of
        x uses)."""
        backend = self.backends["neurons"]
        return lambda rows, slots, pos, dst, n: backend.units(x, rows, slots, active[pos], bias,
                                                              None if mask is None else mask[:, pos], dst, n)

    @staticmethod
    def _blockwise(backend, like, f):
        """fn for `_sum_over` from f(rows, slots, positions), one call per block."""
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
        gu = self._sum_over(layer, "inputs", inputs,  # (never empty: DIP keeps at least one input)
                            self._blockwise(b_in, x, lambda rows, slots, pos: b_in.input_columns(
                                b_in.index(x_in, pos), rows, slots)), None)
        h = b_in.glu(gu[0], gu[1])
        # 2. down rows of the largest pruned GLU outputs
        neurons = dip.select_neurons(layer, b_in.host(h)[0], self._cached_mask(layer, "neurons"))
        self.stats.current.active.append(len(inputs) + len(neurons))
        h_out = b_out.index(h, neurons)
        return self._sum_over(layer, "neurons", neurons,
                              self._blockwise(b_out, x, lambda rows, slots, pos: b_out.row_axpy(
                                  b_out.index(h_out, pos), rows, slots, "down")), b_out.zeros(x))

    def _cached_mask(self, layer: int, region: str) -> Optional[np.ndarray]:
        gamma = getattr(self.sparsifier, "gamma", 1.0)
        return self.caches[layer][region].cached_mask() if gamma != 1.0 else None

    # -- prefill -----------------------------------------------------------------
    def _prefill(self, layer: int, x: mx.array, bias: Dict[str, mx.array]) -> mx.array:
        """The FFN over a prompt from the units sparsity.prompt_units gives all of its tokens, read like one decode
        step: cached units in place, the misses into the cache, the overflow streamed (or read ahead)."""
        if self.dip_layout:
            return self._prefill_dip(layer, x)
        if self.prefetch is not None:  # as a decode step: so the first step after a prompt reads as every later one
            self.prefetch.start((layer + 1) % len(self.caches))
        n = self.fd.layers[layer]["neurons"].n_units
        backend = self.backends["neurons"]
        t = time.perf_counter()
        units = prompt_units(self.sparsifier, layer, lambda: backend.host(x), n)
        self.stats.current.mm_s += time.perf_counter() - t
        return self._sum_over(layer, "neurons", units, self._units_fn(x, units, bias), backend.zeros(x))

    def _prefill_dip(self, layer: int, x: mx.array) -> mx.array:
        """Dense FFN over a prompt in the dip layout, the layer streamed sequentially; the caches are seeded on the way."""
        self._seed(layer, x)
        info = self.info
        g = u = 0
        for pos, rows in self._stream_all(layer, "inputs"):
            a = self.fd.layouts["inputs"].unpack(rows)
            xs = x[..., int(pos[0]) : int(pos[-1]) + 1]
            g, u = g + project(xs, a, "gate", info["matrices"]["gate"]), u + project(xs, a, "up", info["matrices"]["up"])
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

    def attach(self, model) -> "FlashEngine":
        """Serve every FlashFFN of `model` from this engine (e.g. a fresh one with another sparsifier,
        budget or reader) and set `model.flash`; returns the engine it replaced (None if none).
        The streamer of resident weights (offload.py), if any, moves to this engine. The caller
        frees or closes the old one: several engines may share a reader."""
        old = getattr(model, "flash", None)
        if old is not None and old is not self and old.streamer is not None:
            # the model's streamed attention/embedding modules read through it: it moves along
            self.use_streamer(old.streamer)
            old.streamer = None
        for layer in model.layers:
            mlp = layer.mlp
            mlp._engine = self
            if "fc1" in mlp._bias and hasattr(self.sparsifier, "bias"):  # the ReLU oracle needs fc1's bias
                self.sparsifier.bias[mlp._layer] = mlp._bias["fc1"]
        model.flash = self
        return old

    def ahead(self):
        return self.prefetch

    def reset(self):
        """Cold caches and fresh stats (e.g. between benchmark runs)."""
        if self.prefetch is not None:
            self.prefetch.drain()
        for regions in self.caches:
            for c in regions.values():
                c.reset()
        self.stats.reset()


class Prefetch:
    """Dense decoding reads the same uncached units of every layer every token (a layer's cache, once
    full, keeps its lowest units and the rest overflow: one contiguous range). So while layer l computes,
    layer l+1's (after the last layer: the next token's first) are read into the other of two buffers;
    buffers smaller than the overflow (a tight budget) take its first units and the rest streams when the
    layer runs. A layer whose overflow turns out different (the cache was still filling) streams as
    before and the prefetched bytes count as waste."""

    def __init__(self, engine: "FlashEngine", rows: int):
        self.engine = engine
        stride = engine.fd.layouts["neurons"].stride
        self.slack = 2 * max(1, engine.reader.alignment)  # a run's aligned superset
        self.buffers = [AlignedBuffer(rows * stride + self.slack, engine.fd.alignment) for _ in range(2)]
        self.rows = [b.rows(stride)[:rows] for b in self.buffers]
        mx.eval(self.rows)  # views now: a lazy one would need this thread's stream where it is used (a server thread)
        self.pending = {}  # layer -> (buffer index, units, wait, their rows)
        self.wasted_bytes = 0

    def start(self, layer: int):
        cache = self.engine.caches[layer]["neurons"]
        if layer in self.pending or cache.num_used < cache.capacity:  # still filling: the plan may admit more
            return
        units = np.flatnonzero(~cache.cached_mask()).astype(np.int32)[: len(self.rows[0])]
        free = {0, 1} - {b for b, _, _, _ in self.pending.values()}
        if not len(units) or not free:
            return
        b = min(free)  # the other buffer: the current layer computes from its own until the next sync
        buf, stride = self.buffers[b], cache.row_bytes
        if units[-1] - units[0] == len(units) - 1:  # the usual case: a run on flash, one aligned read
            wait, at = self.engine._submit_run(layer, "neurons", int(units[0]), len(units), buf.buffer, buf.base_offset)
            rows = buf.buffer[at : at + len(units) * stride].reshape(len(units), stride)
            mx.eval(rows)  # a view now, as self.rows
        else:
            dest = buf.base_offset + np.arange(len(units), dtype=np.int64) * stride
            wait, rows = self.engine._submit(layer, "neurons", units, buf.buffer, dest), self.rows[b][: len(units)]
        self.pending[layer] = (b, units, wait, rows)

    def take(self, layer: int, units: np.ndarray) -> Optional[mx.array]:
        """The rows of the first units of `units` read ahead for `layer` (waited for), or None."""
        if layer not in self.pending:
            return None
        b, read, wait, rows = self.pending.pop(layer)
        wait()
        if not np.array_equal(read, units[: len(read)]):
            self.wasted_bytes += len(read) * self.rows[b].shape[1]
            return None
        return rows

    def drain(self):
        """Wait for the reads in flight. A read that failed raises its ReadError here: nothing will use its rows,
        but the disk failing is news (the caller reporting a failed layer chains it)."""
        pending, self.pending = list(self.pending.values()), {}
        errors = []
        for _, _, wait, _ in pending:
            try:
                wait()
            except ReadError as e:  # wait for the others first: their buffers must not be reused while in flight
                errors.append(e)
        if errors:
            raise errors[0]


class AlignedBuffer:
    """An evaluated uint8 mx.array whose usable bytes start at an `alignment` boundary (for O_DIRECT)."""

    def __init__(self, nbytes: int, alignment: int):
        self.buffer, self.base_offset = aligned_buffer(nbytes, alignment)
        self.nbytes = nbytes

    def rows(self, stride: int) -> mx.array:
        n = self.nbytes // stride
        return self.buffer[self.base_offset : self.base_offset + n * stride].reshape(n, stride)

    def host_rows(self, stride: int) -> np.ndarray:
        """The same rows as a numpy view (the native kernels read them in place)."""
        n = self.nbytes // stride
        return np.asarray(memoryview(self.buffer))[self.base_offset : self.base_offset + n * stride].reshape(n, stride)
