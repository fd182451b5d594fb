"""The unit step, written once for every kind of unit (neurons.py, experts.py).

Per layer and forward pass a kind says which units it needs (sorted ids) and how to compute over their rows; the
step does the rest:

    active --UnitCache.plan--> hits, misses (admitted into cache slots), overflow (more than the cache holds);
      units read ahead for this layer (read_ahead.py) are used where they are: in their staging rows, not admitted
      (no copy, no eviction for them), or in the cache slots they were read into;
      the misses --reader (pread pool)--> their cache rows
      the blocks of hits computed while the misses are read, then those with units read ahead, then the blocks with
      misses, then those with overflow, read through the scratch buffer a chunk at a time
      every read unit checked against its checksum the first time it is read (io/checks.py)

Results come back per block, in block order. A block is `block` consecutive ids: REDUCTION_UNITS for neurons, whose
partial sums are added in block order, so the sum is the same whatever the budget, cache state or read-ahead; one
for experts, each computed for the tokens that chose it.
"""

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Callable, Dict, List, Optional

import mlx.core as mx
import numpy as np

from ..compute.rows import RowSet
from ..errors import ReadError
from ..io.checks import CHECK_UNITS, UnitChecks
from ..io.memory import give_back
from ..io.reader import AlignedBuffer, aligned_span
from .cache import UnitCache
from .stats import Stats

# Units summed together in one call before partial sums are added, in this order (a multiple of every group size):
# the reduction over units is the same whatever the budget, cache state or read-ahead.
REDUCTION_UNITS = 256


class Blocks:
    """The active units (sorted ids) cut into fixed blocks of `size` ids: block b is positions
    starts[b] : starts[b] + sizes[b] of them."""

    def __init__(self, active: np.ndarray, size: int = REDUCTION_UNITS):
        ids = active // size
        self.starts = np.flatnonzero(np.diff(ids, prepend=-1))
        self.sizes = np.diff(self.starts, append=len(active))
        self._everything = None

    def __len__(self):
        return len(self.starts)

    def select(self, run: list):
        """(positions, dst int32: their block's index in the run) of a run of consecutive blocks."""
        lo, hi = self.starts[run[0]], self.starts[run[-1]] + self.sizes[run[-1]]
        return np.arange(lo, hi), np.repeat(np.arange(len(run), dtype=np.int32), self.sizes[run[0] : run[-1] + 1])

    def everything(self):
        """select() of every block, computed once."""
        if self._everything is None:
            self._everything = self.select(list(range(len(self))))
            for a in self._everything:
                a.flags.writeable = False
        return self._everything


def place(parts: list, group: list, out) -> None:
    """A call's results of blocks `group` into `parts` (one entry a block): a list of one a block as they are, an
    array of all of them [len(group), ...] in each of its blocks' entries (Engine.step hands it on whole)."""
    parts[group[0] : group[-1] + 1] = out if isinstance(out, list) else [out] * len(group)


@dataclass
class ScratchPart:
    """A part of the scratch buffer (AlignedBuffer's fields: submit_rows reads into it)."""

    buffer: mx.array
    base_offset: int
    nbytes: int


class Engine:
    """What every engine of units has: a reader and its stats (reads submitted, the time waited for them counted as
    I/O), per-layer caches ({region: UnitCache}, empty for a layer without units), a scratch buffer, the unit step,
    the read-error guard, reads ahead (`read_ahead`) and the streamer of resident weights."""

    streamer = None  # resident.ResidentStreamer when resident weights are streamed too
    read_ahead = None  # read_ahead.ReadAhead: the next layer's units read while a layer computes
    overlap = True  # compute the hits while the misses are read (False: wait first; for A/B runs)
    context = None  # the tokens the plan's KV cache holds (loader.load): generation stops there
    use_metal = None  # expand encoded units with the Metal kernel (None: where available)
    _last_blocks = None  # (active, block size, Blocks) of the last step (_blocks)
    _scratch_read = None  # (wait, offset) of the chunk `_read_chunks` reads ahead into the scratch buffer

    def __init__(self, fd, reader, caches: List[Dict[str, UnitCache]], scratch_bytes: int):
        self.fd, self.reader, self.caches = fd, reader, caches
        self.stats = Stats([reader])
        self.last_layer = max(i for i, c in enumerate(caches) if c)
        self.scratch = AlignedBuffer(scratch_bytes, fd.alignment)
        self.checks = UnitChecks(fd) if CHECK_UNITS else None

    def use_streamer(self, streamer):
        """Resident weights are streamed through `streamer` (resident.ResidentStreamer): its reads count here."""
        self.streamer, streamer.stats = streamer, self.stats
        self.stats.readers.append(streamer.reader)

    # -- reads -----------------------------------------------------------------
    def submit(self, layer: int, region: str, units: np.ndarray, buffer, dest: np.ndarray) -> Callable[[], None]:
        """Start reading `units` of a region to byte offsets `dest` of `buffer` (one batch; the pool coalesces);
        returns a function that waits for it, counting the time waited as I/O."""
        if len(units) == 0:
            return lambda: None
        r = self.fd.layers[layer][region]
        wait = self._submit_ranges(buffer, *r.requests(units, dest))
        return self._checked(wait, r, units, buffer, dest)

    def submit_run(self, layer: int, region: str, first: int, n: int, buffer, base: int):
        """Start reading units first..first+n-1, neighbours on flash, as the aligned superset of their bytes into
        `buffer` at byte `base` (aligned, with room for n strides and two alignments): one direct read, where
        packed units read one by one would go through the pool's bounce buffers. Returns (wait, the byte offset
        of the first unit in `buffer`)."""
        r = self.fd.layers[layer][region]
        lo = r.unit_offset(first)
        start, end = aligned_span(lo, n * r.stride, max(1, self.reader.alignment))
        wait = self._submit_ranges(buffer, np.array([start]), np.array([end - start]), np.array([base]), n * r.stride)
        at = base + lo - start
        return self._checked(wait, r, np.arange(first, first + n), buffer, at + np.arange(n) * r.stride), at

    def _submit_ranges(self, buffer, offsets: np.ndarray, lengths: np.ndarray, dest: np.ndarray, requested=None):
        """The reads of `submit` (any byte ranges); `requested`: the units' bytes among them (default all: the
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

    def _checked(self, wait, r, units: np.ndarray, buffer, dest: np.ndarray) -> Callable[[], None]:
        """`wait`, then the units' checksums where not checked before (io/checks.py), counted as I/O."""
        if not self.checks:
            return wait

        def checked():
            wait()
            t = time.perf_counter()
            self.checks.check(r, units, buffer, dest)
            self.stats.current.io_s += time.perf_counter() - t

        return checked

    def read_into_slots(self, layer: int, region: str, units: np.ndarray, slots: np.ndarray) -> Callable[[], None]:
        """Start reading units into their cache slots (misses, or units read ahead); returns the function that waits
        for them."""
        cache = self.caches[layer][region]
        return self.submit(
            layer, region, units, cache.buffer, cache.base_offset + slots.astype(np.int64) * cache.row_bytes
        )

    def submit_rows(self, layer: int, region: str, units: np.ndarray, buf: AlignedBuffer):
        """Start reading `units` (sorted) into `buf` as consecutive rows: a run on flash that `buf` holds with its
        aligned superset as one direct read, else one batch. Returns (wait, the byte offset of the first row in
        buf.buffer)."""
        stride = self.fd.layouts[region].disk_stride
        if (
            not self.fd.sources  # (in place, a unit's components are apart)
            and units[-1] - units[0] == len(units) - 1
            and len(units) * stride + 2 * max(1, self.reader.alignment) <= buf.nbytes
        ):
            return self.submit_run(layer, region, int(units[0]), len(units), buf.buffer, buf.base_offset)
        dest = buf.base_offset + np.arange(len(units), dtype=np.int64) * stride
        return self.submit(layer, region, units, buf.buffer, dest), buf.base_offset

    def _read_chunks(self, layer: int, region: str, chunks: List[np.ndarray]):
        """Dense rows [len, stride] of each of `chunks` (units, at most `_fits` a chunk) in turn, read through the
        scratch buffer: the next chunk into one half of it while the caller computes with the other (where a half
        holds a unit), so reads and compute overlap.

        Dense layouts give views of the scratch buffer, overwritten by the chunk after next: evaluate what uses
        them before asking for the next. Encoded units are expanded (evaluated) into new arrays (chunks are sized
        so that those stay within the scratch size too)."""
        self.drain_scratch()  # (a read an earlier, abandoned walk left landing in it)
        parts = self._scratch_parts(region, max(map(len, chunks), default=1))
        for i, chunk in enumerate(chunks):
            if self._scratch_read is None:
                self._scratch_read = self.submit_rows(layer, region, chunk, parts[i % len(parts)])
            (wait, at), self._scratch_read = self._scratch_read, None
            wait()
            if i + 1 < len(chunks) and len(parts) > 1:  # (the caller evaluated what read that half)
                self._scratch_read = self.submit_rows(layer, region, chunks[i + 1], parts[(i + 1) % 2])
            yield self._rows(region, parts[i % len(parts)], at, len(chunk))

    def drain_scratch(self) -> None:
        """Wait for a read into the scratch buffer still under way (its rows unused)."""
        pending, self._scratch_read = self._scratch_read, None
        if pending is not None:
            try:
                pending[0]()
            except ReadError:
                pass

    def _rows(self, region: str, part, at: int, n: int):
        layout = self.fd.layouts[region]
        out = part.buffer[at : at + n * layout.disk_stride].reshape(n, layout.disk_stride)
        if layout.encoded:
            t = time.perf_counter()
            out = layout.expand(out, self.use_metal)
            mx.eval(out)
            self.stats.current.expand_s += time.perf_counter() - t
        return out

    def _scratch_parts(self, region: str, most: int = 1) -> list:
        """The scratch buffer as two aligned halves read in turn where each holds `most` units of `region`, else
        whole."""
        a = max(1, self.reader.alignment)
        half = self.scratch.nbytes // 2 // a * a
        if half - 2 * a < most * self.fd.layouts[region].disk_stride:
            return [self.scratch]
        base = self.scratch.base_offset
        return [ScratchPart(self.scratch.buffer, base + i * half, half) for i in range(2)]

    def gathered_units(self, region: str) -> int:
        """Units whose rows MLX's ops take in one call: each matrix's rows are gathered (copies, all alive while the
        call's graph computes, with any repacking's temporaries: FlashDir.call_bytes), so as many as half the plan's
        workspace holds (the rest: MLX's cache of freed buffers, loader.load, and what MLX does not count), a decode
        step's experts where the plan is MLX's (FlashDir.experts_per_call: budget.fixed_bytes), fewer where it is the
        native step's (Plan.for_forward); no budget: every unit."""
        plan = getattr(self, "plan", None)
        if plan is not None and plan.budget is None:
            return max(r.n_units for r in self.fd.regions())
        room = plan.workspace // 2 if plan is not None else self.scratch.nbytes
        return max(self._fits(region), room // self.fd.call_bytes(region), 1)

    def _fits(self, region: str) -> int:
        """Units a chunk of `_read_chunks` holds."""
        room = self._scratch_parts(region)[0].nbytes
        return max(1, (room - 2 * max(1, self.reader.alignment)) // self.fd.layouts[region].stride)

    def _per_chunk(self, region: str) -> int:
        """Units read through the scratch buffer at a time when a whole region streams: whole aligned blocks of them
        where the scratch holds some (no block read twice by neighbouring runs)."""
        a = max(1, self.reader.alignment)
        step = a // math.gcd(self.fd.layouts[region].disk_stride, a)
        fits = self._fits(region)
        return fits // step * step if fits >= step else fits

    # -- the unit step ------------------------------------------------------------
    def step(
        self,
        layer: int,
        region: str,
        active: np.ndarray,
        fn,
        sync,
        block: int = REDUCTION_UNITS,
        per: Optional[int] = None,
        read_next: Optional[Callable[[], None]] = None,
    ):
        """The results of the active units (sorted ids) of a layer's region in block order: a list of fn's outputs,
        each a list of one result per block, or an array of its blocks' results [blocks, ...] (kept whole).

        fn(rows, slots, positions, dst, n) returns the n results of the blocks of `positions` (into `active`; block
        i: those with dst == i), rows[slots] their rows, or a RowSet (slots None) where they lie in several buffers;
        where fn.folds, a call over every block gets fold=True and may return their sum instead, in block order.
        sync(out) finishes what reads rows before their buffer is reused (rows read ahead into staging rows, a
        chunk streamed through the scratch buffer). Blocks of hits go `per` units a call at most (None: any number),
        synchronised between calls; read_next() starts the next layer's reads ahead once this layer's misses are on
        their way."""
        cache = self.caches[layer][region]
        sync = self.counted(sync)
        ahead = self.read_ahead
        staged = ahead.take(layer) if ahead is not None and ahead.region == region else None
        in_cache = staged is not None and staged.slots is not None
        t = time.perf_counter()
        plan = cache.plan(active, bypass=None if staged is None or in_cache else staged.units)  # used where they are
        s = self.stats.current
        s.mm_s += time.perf_counter() - t
        late = np.isin(active, staged.units) if in_cache else None  # cached, their reads maybe still in flight
        read = len(plan.miss_units) + len(plan.overflow_units) + (int(late.sum()) if in_cache else 0)
        s.misses += read
        s.hits += len(active) - read
        if in_cache and np.isin(plan.miss_slots, staged.slots).any():
            staged.wait()  # a slot read ahead for nothing, now a miss's: its read lands first
        wait = self.read_into_slots(layer, region, plan.miss_units, plan.miss_slots)
        if read_next is not None:
            read_next()
        if not self.overlap or not len(active):
            wait()
        if not len(active):
            if in_cache:
                staged.wait()
            return []
        blocks = self._blocks(active, block)
        whole = {"fold": True} if getattr(fn, "folds", False) else {}  # (for a call over every block)
        if staged is None and not len(plan.miss_units) and not len(plan.overflow_units) and per is None:
            wait()  # every unit cached, all blocks in one call: what compute() below does, without its bookkeeping
            out = fn(cache.rows, plan.slots, *blocks.everything(), len(blocks), **whole)
            return list(out) if isinstance(out, list) else [out]
        where, index = self._where(active, plan, staged)
        # per block: 0 cached rows only, 1 rows read ahead too, 2 misses being read, 3 rows to stream
        reading = (where == 0) & np.isin(active, plan.miss_units)
        ahead_rows = (where == 1) if late is None else late
        kind = np.maximum.reduceat(np.select([where == 2, reading, ahead_rows], [3, 2, 1], 0), blocks.starts)
        parts = [None] * len(blocks)
        buffers = [cache.rows, cache.rows if staged is None else staged.rows]

        alive = []  # calls since the last sync, and their units: MLX ops' gathered rows, at most `per` at a time

        def compute(todo):
            for group in self._groups(todo, blocks.sizes, per or len(active)):
                pos, dst = blocks.select(group)
                if per and alive and sum(n for _, n in alive) + len(pos) > per:
                    sync([out for out, _ in alive])
                    alive.clear()
                fold = whole if len(group) == len(blocks) else {}
                if (where[pos] == 0).all():
                    out = fn(cache.rows, plan.slots[pos], pos, dst, len(group), **fold)
                else:  # rows read ahead among them, in place
                    out = fn(*RowSet(buffers, where[pos], index[pos]).single(), pos, dst, len(group), **fold)
                alive.append((out, len(pos)))
                place(parts, group, out)

        compute(np.flatnonzero(kind == 0))  # the hits, while the misses (and the tail of the reads ahead) arrive
        if ahead_rows.any() or in_cache:  # (in the cache: slots not needed now are reused next token)
            staged.wait()
        compute(np.flatnonzero(kind == 1))  # rows read ahead, in place
        wait()  # before anything reads the misses' rows
        compute(np.flatnonzero(kind == 2))
        if (kind == 3).any():
            self._overflow(layer, region, active, where, index, buffers, np.flatnonzero(kind == 3), blocks, parts, fn,
                           sync)  # fmt: skip
        outs = [p for i, p in enumerate(parts) if i == 0 or p is not parts[i - 1]]
        if (kind == 1).any() and not in_cache:
            sync(outs)  # before the staging rows they read take the layer after next's
        return outs

    def counted(self, sync):
        """`sync`, counting the times it waits for MLX's graph (stats' syncs)."""

        def counted(out):
            if any(isinstance(a, mx.array) for a in (out if isinstance(out, list) else [out])):
                self.stats.current.syncs += 1
            sync(out)

        return counted

    def _blocks(self, active: np.ndarray, block: int) -> Blocks:
        """Blocks(active, block), kept while a selector hands the same read-only array again (a dense layer's every
        unit)."""
        last = self._last_blocks
        if last is None or last[0] is not active or last[1] != block or active.flags.writeable:
            self._last_blocks = last = (active, block, Blocks(active, block))
        return last[2]

    def _where(self, active, plan, staged):
        """Per active unit, where its row is (0: its cache slot, 1: a staging row, 2: to stream through the
        scratch buffer) and its row there. Counts what was staged for nothing and, where the staging followed a
        prediction, how much of `active` it had."""
        where = np.where(plan.slots >= 0, 0, 2)
        index = plan.slots.astype(np.int64)
        if staged is None:
            return where, index
        s = self.stats.current
        s.ahead_wasted_bytes += int((~np.isin(staged.units, active)).sum()) * self.read_ahead.unit_bytes
        if staged.predicted is not None:
            s.routed += len(active)
            s.predicted += int(np.isin(active, staged.predicted).sum())
        over = np.flatnonzero(where == 2)
        if len(over) and len(staged.units):
            at = np.minimum(np.searchsorted(staged.units, active[over]), len(staged.units) - 1)
            found = staged.units[at] == active[over]
            where[over[found]], index[over[found]] = 1, at[found]
        return where, index

    def _overflow(self, layer, region, active, where, index, buffers, todo, blocks, parts, fn, sync):
        """`step`'s blocks with units to stream: read through the scratch buffer a chunk of whole blocks at a time
        (the next read while one computes), their other rows read in place beside them (a RowSet)."""
        streamed = np.add.reduceat(where == 2, blocks.starts)
        groups = [(group, *blocks.select(group)) for group in self._groups(todo, streamed, self._fits(region))]
        mine = [pos[where[pos] == 2] for _, pos, _ in groups]
        for (group, pos, dst), units, scratch in zip(
            groups, mine, self._read_chunks(layer, region, [active[u] for u in mine])
        ):
            index[units] = np.arange(len(units))
            rows = RowSet([*buffers, scratch], where[pos], index[pos])
            out = fn(*rows.single(), pos, dst, len(group))
            sync(out)  # before the chunk after next overwrites these scratch rows
            place(parts, group, out)

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

    def read_overflow(self, layer: int, region: str):
        """The next layer's (after the last: the next token's first) uncached units of `region`, read ahead where
        every unit is computed every token (a dense step: its overflow is the same every token, once its cache is
        full and keeps its units)."""
        nxt = (layer + 1) % len(self.caches)
        cache = self.caches[nxt].get(region)
        if self.read_ahead is None or cache is None or cache.num_used < cache.capacity:  # still filling: not yet
            return
        self.read_ahead.start(nxt, np.flatnonzero(~cache.cached_mask()).astype(np.int32))

    # -- the layer's guard, lifetime --------------------------------------------------
    def guarded(self, layer: int, prefill: bool, compute):
        """compute() as layer `layer`'s units of a forward pass: its stats, and after a failed read the layer's
        caches forget the units admitted for it (rows never filled), so later tokens never compute on unread bytes."""
        self.stats.touch(prefill=prefill)
        try:
            y = compute()
        except ReadError:
            for cache in self.caches[layer].values():
                cache.reset(stats=False)
            if self.read_ahead is not None:
                try:
                    self.read_ahead.drain()
                except ReadError:  # (the one raised already says the disk fails)
                    pass
            self.stats.forward_done()
            raise
        if layer == self.last_layer:
            self.stats.forward_done()
        return y

    def reset(self):
        """Cold caches and fresh stats (e.g. between benchmark runs)."""
        if self.read_ahead is not None:
            self.read_ahead.drain()
        for regions in self.caches:
            for c in regions.values():
                c.reset()
        self.stats.reset()

    @contextmanager
    def lending(self, nbytes: int):
        """The unit caches `nbytes` smaller while the block runs (a prompt's passes take the room: Plan.prompt_loan),
        then as planned; what they hold less than that, the read-ahead buffers lend whole (dropped, then made again).
        Outputs do not change (`resize`); the caches start empty after it."""
        plan, strides = self.plan, self.fd.strides
        if nbytes <= 0 or plan.budget is None:
            yield
            return
        ahead, remake = self.read_ahead, None
        if ahead is not None and nbytes > plan.cache_bytes(strides) and plan.prefetch_rows:
            ahead.drain()
            remake = partial(type(ahead), self, ahead.region, ahead.rows)
            self.read_ahead = ahead = None  # (its buffers freed)
            nbytes -= plan.prefetch_bytes(strides)
        self.resize(plan.resized(self.fd, plan.nbytes(strides) - max(0, nbytes)).capacity)  # (the loan counts the rest)
        give_back()  # (the rows given back before the passes take them)
        try:
            yield
        finally:
            give_back()
            self.resize(plan.capacity)
            if remake is not None:
                self.read_ahead = remake()

    def resize(self, capacity: List[Dict[str, int]]):
        """Each layer's caches to hold capacity[layer][region] units (budget.Plan.resized), between passes: a cache
        whose size changes starts empty (its memory given back, or taken). Outputs do not change: a unit computes
        alike wherever it was read from."""
        if self.read_ahead is not None:
            self.read_ahead.drain()  # (its reads write into the caches' rows)
        for regions, caps in zip(self.caches, capacity):
            for name in list(regions):
                c = regions[name]
                if min(caps[name], c.n_units) == c.capacity:
                    continue
                shape = (c.n_units, caps[name], c.row_bytes, c.policy, c.window, c.alignment, c.compact)
                # the old rows go back before the new ones are taken: the two at once hold a layer's cache more than
                # the plan (a prompt's loan returned: past the budget)
                c = regions[name] = None
                regions[name] = UnitCache(*shape)

    def close(self):
        """Release the readers' files and threads (a read ahead that failed raises, after they are released)."""
        try:
            self.drain_scratch()
            if self.read_ahead is not None:
                self.read_ahead.drain()
        finally:
            self.reader.close()
            if self.streamer is not None:
                self.streamer.close()
