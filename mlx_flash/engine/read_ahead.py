"""Units read ahead of need: while layer l computes, units layer l+1 is expected to need are read, two ways.

What is expected is the kind's business (neurons.py: a full dense cache's overflow, the same every token; experts.py:
the experts the next layer's router picks for this layer's input). When that layer's step runs (units.py), the units
read ahead that it needs are used where they are, and only the shortfall is read. Units it does not need count as
wasted bytes.

* `ReadAhead` (neurons): into two staging buffers of their own, in the budget, which never evict a cache's working
  set; a full dense cache's overflow is the same every token, so caching it would only evict what the next token
  needs again.
* `IntoCache` (experts): into the next layer's cache slots, taken at once (`UnitCache.admit`): the experts a token
  reads ahead stay cached for the tokens after it, as its misses do, and no staging buffer takes budget from the
  cache. The layer's step waits for them before it computes them or reuses a slot of one it did not need.
"""

from dataclasses import dataclass
from typing import Callable, Dict, Optional

import mlx.core as mx
import numpy as np

from ..errors import ReadError
from ..io.reader import AlignedBuffer


@dataclass
class Staged:
    """Units of one layer read ahead, usable once `wait()` returned: in a staging buffer (row i of `rows` / `host`
    is units[i]) or in the layer's cache slots `slots`."""

    buffer: int
    units: np.ndarray
    rows: mx.array
    host: np.ndarray
    wait: Callable[[], None]
    predicted: Optional[np.ndarray] = None  # what the prediction chose (units: those the cache lacked)
    slots: Optional[np.ndarray] = None  # IntoCache: the units' cache slots (rows and host: None)
    span: Optional[slice] = None  # ReadAhead: the rows' bytes in their buffer (`rows` is made where they are taken)


def unit_bytes(fd, region: str) -> int:
    """A unit's bytes as read (Region.unit_bytes: the same in every layer)."""
    return next(layer[region] for layer in fd.layers if region in layer).unit_bytes


class ReadAhead:
    """Two staging buffers of `rows` units of `region`. A layer's step takes what was staged for it (`take`), then
    starts the next layer's reads (`start`) into the other buffer: the one it took stays intact while it computes."""

    def __init__(self, engine, region: str, rows: int):
        self.engine, self.region, self.rows = engine, region, rows
        self.stride = engine.fd.layouts[region].stride
        self.unit_bytes = unit_bytes(engine.fd, region)
        slack = 2 * max(1, engine.reader.alignment)  # room for a run's aligned superset
        self.buffers = [AlignedBuffer(rows * self.stride + slack, engine.fd.alignment) for _ in range(2)]
        self.pending: Dict[int, Staged] = {}
        self.in_use = None  # the buffer `take` gave out last: its layer may still compute from it

    def start(self, layer: int, units: np.ndarray, predicted: Optional[np.ndarray] = None):
        """Start reading `units` (sorted, at most `rows`) of `layer` into a free buffer (none free: not read)."""
        self.drain()  # what no step took (its layer did not run): its buffer is reused
        units = units[: self.rows]
        if not len(units):
            return
        b, engine = 1 if self.in_use == 0 else 0, self.engine
        buf = self.buffers[b]
        wait, at = engine.submit_rows(layer, self.region, units, buf)
        span = slice(at, at + len(units) * self.stride)
        host = buf.host_bytes()[span].reshape(len(units), self.stride)
        engine.stats.current.ahead_bytes += len(units) * self.unit_bytes
        self.pending[layer] = Staged(b, units, None, host, _once(wait), predicted, span=span)

    def take(self, layer: int) -> Optional[Staged]:
        """The units staged for `layer` (not waited for yet), or None. Their rows are a view made here, lazily, in the
        thread that computes from them (MLX's streams are per thread: a server generates in its own)."""
        staged = self.pending.pop(layer, None)
        if staged is not None:
            self.in_use = staged.buffer
            staged.rows = self.buffers[staged.buffer].buffer[staged.span].reshape(len(staged.units), self.stride)
        return staged

    def drain(self):
        """Wait for the reads in flight (their rows are dropped, their bytes wasted). A read that failed raises its
        ReadError here: nothing will use its rows, but the disk failing is news (the caller reporting a failed layer
        chains it)."""
        pending, self.pending = list(self.pending.values()), {}
        errors = []
        for staged in pending:
            self.engine.stats.current.ahead_wasted_bytes += len(staged.units) * self.unit_bytes
            try:
                staged.wait()
            except ReadError as e:  # wait for the others first: their buffers must not be reused while in flight
                errors.append(e)
        if errors:
            raise errors[0]


class IntoCache:
    """Units read ahead into their layer's cache slots (`Staged.slots`), one batch per layer in flight."""

    def __init__(self, engine, region: str, rows: int):
        self.engine, self.region, self.rows = engine, region, rows
        self.stride = engine.fd.layouts[region].stride
        self.unit_bytes = unit_bytes(engine.fd, region)
        self.pending: Dict[int, Staged] = {}

    def start(self, layer: int, units: np.ndarray, predicted: Optional[np.ndarray] = None):
        """Admit `units` (uncached, the most wanted first; at most `rows` taken) into `layer`'s cache, never
        evicting another of `predicted`, and start reading them into their slots."""
        self.drain()  # what no step took: its slots may be taken again now
        cache = self.engine.caches[layer][self.region]
        units, slots = cache.admit(units[: self.rows], keep=predicted)
        if not len(units):
            return
        order = np.argsort(units)  # (neighbours on flash coalesce)
        units, slots = units[order], slots[order]
        wait = self.engine.read_into_slots(layer, self.region, units, slots)
        self.engine.stats.current.ahead_bytes += len(units) * self.unit_bytes
        self.pending[layer] = Staged(None, units, None, None, _once(wait), predicted, slots)

    def take(self, layer: int) -> Optional[Staged]:
        return self.pending.pop(layer, None)

    def drain(self):
        """Wait for the reads no step took (their units stay cached; bytes wasted until a step uses them). A layer
        whose read failed forgets its cache (rows never filled), then the ReadError is raised."""
        pending, self.pending = self.pending, {}
        errors = []
        for layer, staged in pending.items():
            self.engine.stats.current.ahead_wasted_bytes += len(staged.units) * self.unit_bytes
            try:
                staged.wait()
            except ReadError as e:
                self.engine.caches[layer][self.region].reset(stats=False)
                errors.append(e)
        if errors:
            raise errors[0]


def _once(wait):
    """`wait` that returns at once after its first call (a staged read is waited for where it is first needed)."""
    done = []

    def once():
        if not done:
            done.append(True)
            wait()

    return once
