"""Per-layer DRAM cache of FFN units ("LLM in a flash", section 3.3; DIP section 5).

A unit is what one selection picks and one read fetches: a neuron bundle of a dense model (its gate,
up and down rows), an expert of an MoE layer (its gate, up and down matrices). The cache knows units
only by id and row bytes. One `UnitCache` per layer holds up to `capacity` units (`row_bytes` bytes
each) as the rows of ONE preallocated MLX buffer.
The buffer is never reallocated: the native pread pool writes missing units straight into
it, and the FFN computes from the rows of the token's active units.

Memory management, two ways:

* in place (`compact=False`, what the engines use: every backend reads rows by slot): a unit that
  leaves the cache frees its slot, a miss takes a free slot; only the maps change, no row is copied.
* compact (the paper's Figure 6, for a backend that computes over a contiguous prefix of rows):
  1. delete: every unit that leaves the cache leaves a hole; the hole is filled by moving the LAST
     used row into it (one row copy per hole below the new `num_used`, never a shift of everything,
     never a reallocation), both maps are fixed and `num_used` shrinks;
  2. append: the misses get slots `num_used .. num_used + m - 1`.

`plan()` performs the deletions itself (compact: row copies through the numpy view `host`) and
returns where the caller must read the misses. Order of one token, per layer:

    p = cache.plan(active)                       # deletions + row moves happen here
    pool.read(offsets_of(p.miss_units), dest=memoryview(cache.buffer),
              dest_offsets=cache.base_offset + p.miss_slots * cache.row_bytes)
    read p.overflow_units into a scratch buffer  # did not fit: use once, do not cache
    y = ffn(cache.rows, p.slots, scratch, ...)     # slots == -1 marks the overflow ones

Contract for the caller: no MLX computation that reads `rows` may still be pending when
`plan()` is called (plan() overwrites rows in place and MLX evaluates lazily), so evaluate
(or mx.synchronize) the previous token's FFN output first. In practice the sparsifier
already needs the layer input evaluated to choose the active set. Not thread-safe: one
thread plans a given layer's cache at a time.

Policies:

* ``"window"`` (the paper's default, k = 5): a unit stays while it was active in one of
  the last `window` tokens (the current one included). Each step first deletes cached
  units whose last activity is older than that and that are not active now, then appends
  the misses; if the cache is still too full, the least recently active non-active
  units are evicted as well.
* ``"lru"`` / ``"lfu"`` (DIP section 5.1), under the byte budget: keep everything until the
  cache is full; then each miss evicts the least recently / least frequently used unit
  that is not in the current active set. LFU counts every activation in the session
  (including activations while not cached: "perfect" LFU, cleared by reset()); its ties
  are broken by recency, then by unit id. LRU/window ties are broken by unit id.

In every policy the active units of the current token are never evicted, so the misses
can always be admitted unless the active set itself is larger than the cache: exactly then
``len(active) - capacity`` active units go to ``overflow_units`` (DIP: "loaded directly
to the processing unit" without caching). Which misses overflow: the lowest-scored ones if
`scores` is given, otherwise the highest unit ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import mlx.core as mx
import numpy as np

from ..io.memory import huge_pages

__all__ = [
    "UnitCache",
    "Plan",
    "CacheStats",
    "POLICIES",
    "cache_aware_scores",
    "capacity_for_budget",
]

POLICIES = ("window", "lru", "lfu")

_NEVER = np.iinfo(np.int64).min // 4  # last_active of a unit never seen


def capacity_for_budget(budget_bytes: int, row_bytes: int) -> int:
    """How many rows of `row_bytes` fit in `budget_bytes` (floor; 0 if none)."""
    budget_bytes = int(budget_bytes)
    row_bytes = int(row_bytes)
    if row_bytes <= 0:
        raise ValueError(f"row_bytes must be positive, got {row_bytes}")
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
    return budget_bytes // row_bytes


def cache_aware_scores(
    x_abs: Union[np.ndarray, mx.array],
    cached: Union[np.ndarray, mx.array],
    gamma: float = 0.2,
) -> Union[np.ndarray, mx.array]:
    """DIP-CA re-weighting (DIP eq. 10): ``s = |x| * (c + gamma * (1 - c)) / max|x|``.

    `x_abs`: activation magnitudes (|x| is taken again, so signed values work too), shape
    [..., n]; the max is over the last axis. `cached`: bool mask [n] (or broadcastable),
    True for units currently in the cache. Non-cached units are penalised by `gamma`
    (0 < gamma <= 1; gamma = 1 gives plain |x| / max|x|). Use the result instead of |x|
    for top-K so that cached units win close calls. An all-zero row gives all-zero
    scores (no division by zero). Returns the same kind of array as `x_abs`
    (numpy in, float numpy out; mx in, mx out).
    """
    gamma = float(gamma)
    if isinstance(x_abs, mx.array):
        a = mx.abs(x_abs)
        if not mx.issubdtype(a.dtype, mx.floating):
            a = a.astype(mx.float32)
        c = cached if isinstance(cached, mx.array) else mx.array(np.asarray(cached, dtype=bool))
        w = mx.where(c.astype(mx.bool_), mx.array(1.0, a.dtype), mx.array(gamma, a.dtype))
        m = mx.max(a, axis=-1, keepdims=True)
        m = mx.where(m > 0, m, mx.array(1.0, a.dtype))
        return a * w / m
    a = np.abs(np.asarray(x_abs))
    if not np.issubdtype(a.dtype, np.floating):
        a = a.astype(np.float32)
    c = np.asarray(cached, dtype=bool)
    w = np.where(c, a.dtype.type(1.0), a.dtype.type(gamma))
    if a.size == 0:
        return a * w
    m = np.max(a, axis=-1, keepdims=True)
    m = np.where(m > 0, m, a.dtype.type(1.0))
    return (a * w / m).astype(a.dtype, copy=False)


@dataclass(frozen=True)
class Plan:
    """What one token needs from one layer's cache (all arrays numpy)."""

    slots: np.ndarray  # int32 [k]: cache slot of each active unit, -1 if in overflow
    miss_units: np.ndarray  # int32 [m]: units to read from flash into the cache (ascending)
    miss_slots: np.ndarray  # int32 [m]: the slot each miss must be written to (ascending, contiguous)
    overflow_units: np.ndarray  # int32 [o]: active units that did not fit (read to scratch)
    evicted: int  # units deleted from the cache in this step
    moved_rows: int  # rows copied inside DRAM to fill holes (memory-management cost)
    moved_bytes: int = 0  # moved_rows * row_bytes
    hits: int = 0  # active units already cached
    step: int = 0  # the token step this plan was made for

    @property
    def read_units(self) -> int:
        """Bundles to read from flash for this token (misses + overflow)."""
        return int(self.miss_units.size + self.overflow_units.size)


@dataclass
class CacheStats:
    """Cumulative counters since construction or the last reset(stats=True)."""

    steps: int = 0
    active: int = 0  # sum of active-set sizes
    hits: int = 0
    misses: int = 0  # admitted misses (read into the cache)
    overflow: int = 0  # active units read to scratch, not cached
    evicted: int = 0
    moved_rows: int = 0
    moved_bytes: int = 0
    row_bytes: int = field(default=0, repr=False)

    @property
    def read_bytes(self) -> int:
        """Bytes the plans asked to read from flash (misses + overflow)."""
        return (self.misses + self.overflow) * self.row_bytes

    @property
    def hit_rate(self) -> float:
        return self.hits / self.active if self.active else 0.0


class UnitCache:
    """One layer's DRAM cache of units (paper section 3.3).

    Attributes the runtime uses:

    * ``buffer``: the base mx.array (uint8, ``capacity * row_bytes + alignment`` bytes,
      evaluated once, never reallocated). The pread pool writes row ``s`` at byte
      ``base_offset + s * row_bytes`` of ``memoryview(buffer)``.
    * ``base_offset``: byte offset of row 0 inside ``buffer``; row 0's address is a
      multiple of `alignment` (MLX CPU arrays are not page aligned, O_DIRECT needs it).
    * ``rows``: mx.array view [capacity, row_bytes] uint8 of the same memory (reinterpret
      with ``rows.view(dtype)`` for the FFN); only rows ``< num_used`` hold units.
    * ``host``: numpy uint8 view [capacity, row_bytes] of the same memory (no copy).
    * ``slot_to_unit`` (int32 [capacity], -1 when free), ``unit_to_slot`` (int32
      [n_units], -1 when absent), ``num_used`` (slots 0..num_used-1 used, contiguous),
      ``last_active`` (int64 [n_units], last step a unit was active), ``use_count``
      (int64 [n_units], LFU), ``step`` (tokens planned since reset), ``stats``.
    """

    def __init__(
        self,
        n_units: int,
        capacity: int,
        row_bytes: int,
        policy: str = "window",
        window: int = 5,
        alignment: int = 4096,
        compact: bool = True,
    ):
        n_units, capacity, row_bytes = int(n_units), int(capacity), int(row_bytes)
        window, alignment = int(window), int(alignment)
        if n_units < 0:
            raise ValueError(f"n_units must be >= 0, got {n_units}")
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        if row_bytes <= 0:
            raise ValueError(f"row_bytes must be positive, got {row_bytes}")
        if alignment < 1 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        if row_bytes % alignment:
            raise ValueError(f"row_bytes ({row_bytes}) must be a multiple of alignment ({alignment})")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if policy == "window" and window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        # More slots than units can never be used; do not allocate them.
        capacity = min(capacity, n_units)

        self.n_units = n_units
        self.capacity = capacity
        self.row_bytes = row_bytes
        self.policy = policy
        self.window = window
        self.compact = bool(compact)
        self.alignment = alignment

        nbytes = capacity * row_bytes
        self.buffer = mx.zeros((nbytes + alignment,), dtype=mx.uint8)
        mx.eval(self.buffer)
        whole = np.asarray(memoryview(self.buffer))
        if not whole.flags.writeable or whole.size != nbytes + alignment:
            raise RuntimeError("MLX did not expose the cache buffer as writable contiguous memory")
        huge_pages(whole)
        addr = whole.__array_interface__["data"][0]
        self.base_offset = int((-addr) % alignment)
        self.host = whole[self.base_offset : self.base_offset + nbytes].reshape(capacity, row_bytes)
        self.rows = self.buffer[self.base_offset : self.base_offset + nbytes].reshape(capacity, row_bytes)
        mx.eval(self.rows)

        self._every = None  # every unit's id (plan_whole)
        self.whole_call = None  # what a caller bound to the rows of plan_whole's units (NeuronEngine._decode_whole)
        self.slot_to_unit = np.full(capacity, -1, dtype=np.int32)
        self.unit_to_slot = np.full(n_units, -1, dtype=np.int32)
        self.last_active = np.full(n_units, _NEVER, dtype=np.int64)
        self.use_count = np.zeros(n_units, dtype=np.int64)
        self.num_used = 0
        self.step = 0
        self.stats = CacheStats(row_bytes=row_bytes)

    # ------------------------------------------------------------------ queries

    @property
    def nbytes(self) -> int:
        """DRAM held by the cache rows (without the alignment slack)."""
        return self.capacity * self.row_bytes

    def cached_mask(self) -> np.ndarray:
        """bool [n_units]: True for units currently in the cache."""
        return self.unit_to_slot >= 0

    def cached_units(self) -> np.ndarray:
        """int32 [num_used]: the unit in each used slot, in slot order (a copy)."""
        return self.slot_to_unit[self.slot_to_unit >= 0]

    def contains(self, units) -> Union[bool, np.ndarray]:
        """Whether each unit is cached (bool for a scalar, bool array otherwise)."""
        idx = np.asarray(units)
        res = self.unit_to_slot[idx] >= 0
        return bool(res) if idx.ndim == 0 else res

    def slots_of(self, units) -> np.ndarray:
        """int32 slot of each unit, -1 where not cached."""
        return self.unit_to_slot[np.asarray(units)]

    def row_address(self, slot: int = 0) -> int:
        """Address of row `slot` in memory (for alignment checks and native callers)."""
        return int(self.host.__array_interface__["data"][0]) + int(slot) * self.row_bytes

    # ------------------------------------------------------------------ state

    def reset(self, stats: bool = True) -> None:
        """Cold cache: forget every unit, history and (by default) the counters.

        The buffer is kept (its bytes are left as they are; they are garbage once
        num_used = 0)."""
        self.slot_to_unit.fill(-1)
        self.unit_to_slot.fill(-1)
        self.last_active.fill(_NEVER)
        self.use_count.fill(0)
        self.num_used = 0
        self.step = 0
        if stats:
            self.stats = CacheStats(row_bytes=self.row_bytes)

    # ------------------------------------------------------------------ planning

    def _check_active(self, active) -> np.ndarray:
        a = np.asarray(active)
        if a.ndim != 1:
            raise ValueError(f"active must be a 1-D array of unit ids, got shape {a.shape}")
        if a.size == 0:
            return a.astype(np.int64)
        if not np.issubdtype(a.dtype, np.integer):
            raise ValueError(f"active must hold integers, got dtype {a.dtype}")
        a = a.astype(np.int64, copy=False)
        if a[0] < 0 or a[-1] >= self.n_units:
            raise ValueError(f"active unit ids must lie in [0, {self.n_units})")
        if a.size > 1 and not np.all(a[1:] > a[:-1]):
            raise ValueError("active must be sorted and unique")
        return a

    def _victims(self, cand: np.ndarray, m: int) -> np.ndarray:
        """The `m` candidate units (int64 ids) to evict first under the policy."""
        if m <= 0:
            return cand[:0]
        if m >= cand.size:
            return cand
        n = max(self.n_units, 1)
        last = self.last_active[cand]  # cached units were all active once: 0 <= last < step
        steps = self.step + 1
        if self.policy == "lfu":
            cnt = self.use_count[cand]
            if steps * steps * n < 2**62:
                key = (cnt * steps + last) * n + cand
            else:
                order = np.lexsort((cand, last, cnt))
                return cand[order[:m]]
        else:
            if steps * n < 2**62:
                key = last * n + cand
            else:
                order = np.lexsort((cand, last))
                return cand[order[:m]]
        # keys are unique (they embed the unit id), so the partition is exact
        return cand[np.argpartition(key, m - 1)[:m]]

    def plan(self, active, scores: Optional[np.ndarray] = None, bypass: Optional[np.ndarray] = None) -> Plan:
        """Admit one token's active set (sorted unique int unit ids).

        Deletes/evicts per policy, moves rows to keep slots 0..num_used-1 contiguous
        (the copies happen here, through `host`), assigns slots to the misses, updates
        recency/frequency and advances the step. The caller then writes each
        ``miss_units[i]`` into slot ``miss_slots[i]`` and reads ``overflow_units`` into a
        scratch buffer. `scores` (optional, [len(active)] aligned with `active`, or
        [n_units]) decides which misses overflow when the active set exceeds the
        capacity: the highest-scored misses are cached. Misses in `bypass` (units the caller already holds
        elsewhere, e.g. read ahead) go to overflow: neither admitted nor evicting anything.
        """
        act = self._check_active(active)
        k = act.size
        t = self.step
        used = self.num_used
        s2n = self.slot_to_unit
        n2s = self.unit_to_slot

        act_slots = n2s[act]
        hit = act_slots >= 0
        n_hit = int(np.count_nonzero(hit))
        if n_hit == k == used:  # every cached unit active and found (a layer held whole): nothing to evict or read
            none = np.zeros(0, np.int32)
            return self._commit(act, act_slots, n_hit, none, none, none, 0, 0)
        miss = act[~hit]
        held = np.zeros(miss.size, dtype=bool)
        if bypass is not None and miss.size:
            held = np.isin(miss, bypass)
        bypassed, miss = miss[held], miss[~held]
        n_admit = min(miss.size, self.capacity - n_hit)  # hits are never evicted

        # ---- choose the units to delete (never one of the current active set)
        used_slots = np.arange(used) if self.compact else np.flatnonzero(s2n >= 0)
        cached = s2n[used_slots].astype(np.int64)
        keep = np.zeros(self.capacity, dtype=bool)
        keep[act_slots[hit]] = True
        keep_active = keep[used_slots]
        delete = np.zeros(used, dtype=bool)
        if self.policy == "window":
            delete = (self.last_active[cached] < t - self.window + 1) & ~keep_active
        need = n_admit - (self.capacity - (used - int(np.count_nonzero(delete))))
        if need > 0:
            cand_mask = ~keep_active & ~delete
            cand = cached[cand_mask]
            victims = self._victims(cand, need)
            delete[np.searchsorted(used_slots, n2s[victims])] = True
        del_slots = used_slots[delete]
        n_del = del_slots.size

        moved = 0
        n2s[cached[delete]] = -1
        if n_del and not self.compact:  # a unit's row stays where it was read: the slot is free, only maps change
            s2n[del_slots] = -1
            used -= n_del
        elif n_del:  # compact: move the last used rows into the holes (paper Figure 6)
            new_used = used - n_del
            holes = del_slots[del_slots < new_used]  # ascending
            if holes.size:
                tail = np.arange(new_used, used)
                sources = tail[~delete[new_used:used]][::-1]  # last used row first
                moved = holes.size
                host = self.host
                # row by row: no temporary of moved_rows * row_bytes, and faster than a
                # fancy-index copy for bundle-sized rows
                for h, s in zip(holes.tolist(), sources.tolist()):
                    host[h] = host[s]
                movers = s2n[sources]
                s2n[holes] = movers
                n2s[movers] = holes.astype(np.int32)
            s2n[new_used:used] = -1
            used = new_used

        # ---- choose which misses are admitted and which overflow
        if n_admit < miss.size:
            if scores is not None:
                sc = np.asarray(scores)
                if sc.shape == (k,):
                    ms = sc[~hit][~held]
                elif sc.shape == (self.n_units,):
                    ms = sc[miss]
                else:
                    raise ValueError(f"scores must have shape ({k},) or ({self.n_units},), got {sc.shape}")
                order = np.argsort(-ms.astype(np.float64), kind="stable")
                adm_mask = np.zeros(miss.size, dtype=bool)
                adm_mask[order[:n_admit]] = True
                admitted, overflow = miss[adm_mask], miss[~adm_mask]
            else:
                admitted, overflow = miss[:n_admit], miss[n_admit:]
        else:
            admitted, overflow = miss, miss[:0]
        if bypassed.size:
            overflow = np.sort(np.concatenate([overflow, bypassed]))

        # ---- the admitted misses take free slots (compact: the ones after the used prefix)
        if self.compact:
            miss_slots = np.arange(used, used + admitted.size, dtype=np.int32)
        else:
            miss_slots = np.flatnonzero(s2n < 0)[: admitted.size].astype(np.int32)
        s2n[miss_slots] = admitted
        n2s[admitted] = miss_slots
        self.num_used = used + admitted.size
        return self._commit(act, n2s[act], n_hit, admitted, miss_slots, overflow, n_del, moved)

    def admit(self, units: np.ndarray, keep: Optional[np.ndarray] = None):
        """Slots for `units` (none cached; the most wanted first) ahead of a step that may need them (a read ahead,
        in place only): free slots first, then the policy's victims, never one of `keep` (cached units that step is
        expected to use too). They count as never active, so a step that does not use them lets them go first
        (window: at once). Returns (the units admitted: as many as there are slots for, their slots); the caller reads
        them into the slots before the next plan or compute touches those rows."""
        if self.compact:
            raise ValueError("admit() fills slots in place; a compact cache keeps its rows contiguous")
        units = np.asarray(units, dtype=np.int64)
        s2n, n2s = self.slot_to_unit, self.unit_to_slot
        free = np.flatnonzero(s2n < 0)
        if len(units) > len(free):
            cached = s2n[s2n >= 0].astype(np.int64)
            if keep is not None:
                cached = cached[~np.isin(cached, keep)]
            units = units[: len(free) + len(cached)]
            victims = self._victims(cached, len(units) - len(free))
            s2n[n2s[victims]] = -1
            n2s[victims] = -1
            self.stats.evicted += len(victims)
            self.num_used -= len(victims)
            free = np.flatnonzero(s2n < 0)
        slots = free[: len(units)].astype(np.int32)
        s2n[slots], n2s[units] = units, slots
        self.last_active[units] = -1  # never active (not _NEVER: _victims' keys multiply it)
        self.num_used += len(units)
        return units.astype(np.int32), slots

    def plan_whole(self) -> Optional[Plan]:
        """plan(every unit) where the cache holds every unit, without plan's checks and lookups (each unit's slot is
        unit_to_slot): None where it does not."""
        if self.num_used != self.n_units:
            return None
        if self._every is None:
            self._every = np.arange(self.n_units, dtype=np.int64)
        none = np.zeros(0, np.int32)
        return self._commit(self._every, self.unit_to_slot, self.n_units, none, none, none, 0, 0)

    def _commit(self, act, slots, n_hit, admitted, miss_slots, overflow, n_del, moved) -> Plan:
        """The step's history and stats, and its Plan."""
        t = self.step
        if act.size == self.n_units:  # (sorted and unique: every unit)
            self.last_active.fill(t)
            self.use_count += 1
        else:
            self.last_active[act] = t
            self.use_count[act] += 1
        self.step = t + 1

        st = self.stats
        st.steps += 1
        st.active += act.size
        st.hits += n_hit
        st.misses += int(admitted.size)
        st.overflow += int(overflow.size)
        st.evicted += int(n_del)
        st.moved_rows += moved
        st.moved_bytes += moved * self.row_bytes

        return Plan(
            slots=slots,
            miss_units=admitted.astype(np.int32),
            miss_slots=miss_slots,
            overflow_units=overflow.astype(np.int32),
            evicted=int(n_del),
            moved_rows=int(moved),
            moved_bytes=int(moved) * self.row_bytes,
            hits=n_hit,
            step=t,
        )

    def __repr__(self) -> str:
        return (
            f"UnitCache(n_units={self.n_units}, capacity={self.capacity}, "
            f"row_bytes={self.row_bytes}, policy={self.policy!r}, window={self.window}, "
            f"num_used={self.num_used}, step={self.step})"
        )
