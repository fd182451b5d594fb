"""UnitCache (paper section 3.3), its policies (window / LRU / LFU) and DIP-CA scores.

The property tests drive random sequences of active sets through a cache, act as the pread
pool would (write a neuron-specific byte pattern into every miss slot through `host`), and
after every step check the maps, the slot bookkeeping, the row contents (through numpy
and through MLX ops on `rows`) and the policy decisions against a plain set-based
reference model.
"""

import os

import mlx_flash  # noqa: F401  (OpenBLAS before mlx.core)
from mlx_flash.engine.cache import POLICIES, UnitCache, cache_aware_scores, capacity_for_budget

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

RB = 4096  # row bytes used by most tests


# ----------------------------------------------------------------------------- helpers


def pattern_np(neurons, row_bytes):
    """The bytes the 'flash file' holds for each neuron: distinct per neuron and per byte."""
    n = np.asarray(neurons, dtype=np.int64).reshape(-1, 1)
    j = np.arange(row_bytes, dtype=np.int64).reshape(1, -1)
    return ((j * 7 + n * 31 + (j // 256) * n + 1) % 251).astype(np.uint8)


def pattern_mx(neurons, row_bytes):
    n = mx.array(np.asarray(neurons, dtype=np.int32)).reshape(-1, 1)
    j = mx.arange(row_bytes, dtype=mx.int32).reshape(1, -1)
    return ((j * 7 + n * 31 + (j // 256) * n + 1) % 251).astype(mx.uint8)


def write_misses(cache, plan):
    """What the pread pool does: write each miss's bundle into its slot."""
    if plan.miss_units.size:
        cache.host[plan.miss_slots] = pattern_np(plan.miss_units, cache.row_bytes)


def check_maps(cache):
    u = cache.num_used
    s2n, n2s = cache.slot_to_unit, cache.unit_to_slot
    assert 0 <= u <= cache.capacity
    assert np.all(s2n[u:] == -1), "unused slots must be -1"
    assert np.all(s2n[:u] >= 0)
    assert np.array_equal(n2s[s2n[:u]], np.arange(u)), "maps are not inverse"
    cached = np.flatnonzero(n2s >= 0)
    assert cached.size == u, "slot leak: num_used != number of cached neurons"
    assert np.array_equal(s2n[n2s[cached]], cached)
    assert np.array_equal(cache.cached_mask(), n2s >= 0)


def check_rows(cache, with_mx=True):
    u = cache.num_used
    neurons = cache.slot_to_unit[:u]
    assert np.array_equal(cache.host[:u], pattern_np(neurons, cache.row_bytes)), "row content lost its neuron"
    if with_mx and u:
        got = cache.rows[:u]
        assert mx.array_equal(got, pattern_mx(neurons, cache.row_bytes)).item()
        # the FFN path: gather rows by slot with mx.take, reduce with mx ops
        idx = mx.array(np.arange(u, dtype=np.int32)[::-1].copy())
        sums = mx.sum(mx.take(cache.rows, idx, axis=0).astype(mx.int64), axis=1)
        exp = pattern_np(neurons[::-1], cache.row_bytes).astype(np.int64).sum(axis=1)
        assert np.array_equal(np.array(sums), exp)


class RefCache:
    """Set-based reference: which neurons are cached, with the documented policy rules."""

    def __init__(self, n, capacity, policy, window):
        self.cap = min(capacity, n)
        self.policy, self.window = policy, window
        self.cached = set()
        self.last = {}
        self.count = {}
        self.step = 0

    def key(self, x):
        if self.policy == "lfu":
            return (self.count.get(x, 0), self.last.get(x, -1), x)
        return (self.last.get(x, -1), x)

    def plan(self, active, scores=None):
        t = self.step
        A = set(active)
        hits = A & self.cached
        misses = sorted(A - self.cached)
        n_admit = min(len(misses), self.cap - len(hits))
        before = set(self.cached)
        if self.policy == "window":
            self.cached = {x for x in self.cached if x in A or self.last[x] >= t - self.window + 1}
        need = n_admit - (self.cap - len(self.cached))
        if need > 0:
            cands = sorted(self.cached - A, key=self.key)
            self.cached -= set(cands[:need])
        evicted = len(before - self.cached)
        if scores is not None and n_admit < len(misses):
            sc = {x: s for x, s in zip(active, scores)}
            ordered = sorted(misses, key=lambda x: -float(sc[x]))  # stable: ties keep id order
        else:
            ordered = misses
        admitted, overflow = set(ordered[:n_admit]), set(ordered[n_admit:])
        self.cached |= admitted
        for x in A:
            self.last[x] = t
            self.count[x] = self.count.get(x, 0) + 1
        self.step += 1
        return overflow, evicted


def run_and_check(cache, ref, steps, with_mx=True):
    """Drive both caches; check every invariant after every step."""
    tot = dict(evicted=0, moved=0, hits=0, misses=0, overflow=0)
    addr0 = cache.row_address(0)
    for active, scores in steps:
        active = np.asarray(active, dtype=np.int64)
        used0 = cache.num_used
        before = cache.slot_to_unit[:used0].copy()
        was_cached = cache.contains(active) if active.size else np.zeros(0, bool)

        plan = cache.plan(active, scores)
        write_misses(cache, plan)

        # -- every active neuron is cached at its returned slot, or in overflow
        assert plan.slots.shape == active.shape and plan.slots.dtype == np.int32
        ov = set(plan.overflow_units.tolist())
        for x, s in zip(active.tolist(), plan.slots.tolist()):
            if s >= 0:
                assert cache.unit_to_slot[x] == s and x not in ov
            else:
                assert x in ov and cache.unit_to_slot[x] == -1
        assert ov <= set(active.tolist())
        assert len(ov) == max(0, active.size - cache.capacity), "overflow iff the active set exceeds capacity"
        # hits were never evicted; misses are exactly the non-cached, non-overflow ones
        assert plan.hits == int(was_cached.sum())
        assert set(plan.miss_units.tolist()) == set(active[~was_cached].tolist()) - ov
        # misses appended at the end, contiguous, after the deletions
        m = plan.miss_slots.size
        assert np.array_equal(plan.miss_slots, np.arange(cache.num_used - m, cache.num_used))
        assert cache.num_used == used0 - plan.evicted + m

        # -- paper Figure 6: only holes below the new num_used are filled, by tail rows
        new_used = used0 - plan.evicted
        gone = ~cache.contains(before) if used0 else np.zeros(0, bool)
        assert int(gone.sum()) == plan.evicted
        assert plan.moved_rows == int(gone[:new_used].sum())
        assert plan.moved_bytes == plan.moved_rows * cache.row_bytes
        for i in range(new_used):  # survivors below the line keep their slot (no shifting)
            if not gone[i]:
                assert cache.unit_to_slot[before[i]] == i
        for i in range(new_used, used0):  # survivors above the line moved into holes
            if not gone[i]:
                assert 0 <= cache.unit_to_slot[before[i]] < new_used and gone[cache.unit_to_slot[before[i]]]

        check_maps(cache)
        check_rows(cache, with_mx)

        # -- policy decisions equal the reference model's
        r_over, r_evicted = ref.plan(active.tolist(), None if scores is None else list(scores))
        assert set(np.flatnonzero(cache.cached_mask()).tolist()) == ref.cached
        assert ov == r_over
        assert plan.evicted == r_evicted

        tot["evicted"] += plan.evicted
        tot["moved"] += plan.moved_rows
        tot["hits"] += plan.hits
        tot["misses"] += m
        tot["overflow"] += len(ov)
    st_ = cache.stats
    assert (st_.evicted, st_.moved_rows, st_.hits, st_.misses, st_.overflow) == (
        tot["evicted"],
        tot["moved"],
        tot["hits"],
        tot["misses"],
        tot["overflow"],
    )
    assert cache.row_address(0) == addr0, "the buffer must never be reallocated"


# ----------------------------------------------------------------------------- strategies


@st.composite
def scenarios(draw, policy=None):
    n = draw(st.integers(1, 40))
    # mostly under pressure (capacity well below n), sometimes roomy or zero
    cap = draw(st.one_of(st.integers(0, max(1, n // 2)), st.integers(0, n + 2)))
    pol = policy or draw(st.sampled_from(POLICIES))
    window = draw(st.integers(1, 6))
    # skewed activity so that caches see hits, evictions, ties and overflow
    hot = draw(st.integers(1, n))
    steps = []
    for _ in range(draw(st.integers(1, 25))):
        size = draw(st.integers(0, n))
        ids = draw(st.lists(st.integers(0, n - 1), max_size=size))
        ids += draw(st.lists(st.integers(0, hot - 1), max_size=hot))
        active = sorted(set(ids))
        scores = None
        if draw(st.booleans()):
            scores = draw(st.lists(st.integers(0, 5), min_size=len(active), max_size=len(active)))
            scores = np.asarray(scores, dtype=np.float32)
        steps.append((active, scores))
    return n, cap, pol, window, steps


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------------------- property tests


@pytest.mark.parametrize("policy", POLICIES)
@SETTINGS
@given(data=st.data())
def test_random_sequences_keep_every_invariant(policy, data):
    n, cap, pol, window, steps = data.draw(scenarios(policy))
    cache = UnitCache(n, cap, RB, policy=pol, window=window)
    run_and_check(cache, RefCache(n, cap, pol, window), steps)


@SETTINGS
@given(scenarios(), st.integers(0, 24))
def test_reset_mid_sequence_is_a_cold_cache(sc, at):
    n, cap, pol, window, steps = sc
    cache = UnitCache(n, cap, RB, policy=pol, window=window)
    at = min(at, len(steps))
    run_and_check(cache, RefCache(n, cap, pol, window), steps[:at], with_mx=False)
    cache.reset()
    assert cache.num_used == 0 and cache.step == 0 and not cache.cached_mask().any()
    check_maps(cache)
    run_and_check(cache, RefCache(n, cap, pol, window), steps[at:], with_mx=False)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 30), st.integers(1, 6), st.data())
def test_window_without_pressure_holds_exactly_the_last_k_tokens(n, k, data):
    """capacity >= n: cached set == union of the active sets of the last k tokens."""
    cache = UnitCache(n, n, RB, policy="window", window=k)
    history = []
    for _ in range(data.draw(st.integers(1, 20))):
        active = sorted(set(data.draw(st.lists(st.integers(0, n - 1), max_size=n))))
        history.append(set(active))
        p = cache.plan(np.array(active, dtype=np.int64))
        assert p.overflow_units.size == 0
        expect = set().union(*history[-k:])
        assert set(np.flatnonzero(cache.cached_mask()).tolist()) == expect
        check_maps(cache)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(["lru", "lfu"]), st.integers(1, 30), st.data())
def test_lru_lfu_fill_before_evicting(pol, n, data):
    """LRU/LFU keep everything until full: no eviction while the union seen fits."""
    cap = data.draw(st.integers(1, n))
    cache = UnitCache(n, cap, RB, policy=pol)
    seen = set()
    for _ in range(data.draw(st.integers(1, 20))):
        active = sorted(set(data.draw(st.lists(st.integers(0, n - 1), max_size=cap))))
        seen |= set(active)
        p = cache.plan(np.array(active, dtype=np.int64))
        if len(seen) <= cap:
            assert p.evicted == 0 and set(np.flatnonzero(cache.cached_mask()).tolist()) == seen
        else:
            assert cache.num_used == cap  # full from then on, never drained
            break


# ----------------------------------------------------------------------------- explicit cases


def cached_set(cache):
    return set(np.flatnonzero(cache.cached_mask()).tolist())


def test_window_example_by_hand():
    c = UnitCache(10, 10, RB, policy="window", window=2)
    c.plan(np.array([0, 1]))
    c.plan(np.array([2]))
    assert cached_set(c) == {0, 1, 2}
    p = c.plan(np.array([3]))  # step 2: keep last_active >= 1 -> {2, 3}
    assert cached_set(c) == {2, 3} and p.evicted == 2
    p = c.plan(np.array([0, 2]))  # 3 stays (active at step 2), 0 comes back
    assert cached_set(c) == {0, 2, 3} and p.evicted == 0
    assert p.miss_units.tolist() == [0] and p.hits == 1


def test_window_evicts_least_recent_when_full():
    c = UnitCache(10, 3, RB, policy="window", window=5)
    c.plan(np.array([0]))
    c.plan(np.array([1]))
    c.plan(np.array([2]))
    p = c.plan(np.array([2, 3]))  # all still in the window, full: evict 0 (oldest)
    assert cached_set(c) == {1, 2, 3} and p.evicted == 1
    assert p.overflow_units.size == 0


def test_lru_example_by_hand():
    c = UnitCache(10, 3, RB, policy="lru")
    for x in (0, 1, 2, 3):
        c.plan(np.array([x]))
    assert cached_set(c) == {1, 2, 3}  # 0 was least recent
    c.plan(np.array([1]))
    c.plan(np.array([4]))  # {1: step 4, 2: step 2, 3: step 3} -> evict 2
    assert cached_set(c) == {1, 3, 4}
    c.plan(np.array([5, 6]))  # ties resolved by recency: 3 (step 3) then 1 (step 4)
    assert cached_set(c) == {4, 5, 6}


def test_lfu_example_by_hand():
    c = UnitCache(10, 2, RB, policy="lfu")
    c.plan(np.array([0]))
    c.plan(np.array([0]))
    c.plan(np.array([1]))
    c.plan(np.array([2]))  # 0 used twice, 1 once -> evict 1
    assert cached_set(c) == {0, 2}
    c2 = UnitCache(10, 2, RB, policy="lfu")
    for x in (0, 1, 2):  # equal counts: tie by recency -> evict 0
        c2.plan(np.array([x]))
    assert cached_set(c2) == {1, 2}


def test_active_neurons_are_never_evicted_even_when_least_used():
    for pol in POLICIES:
        c = UnitCache(10, 3, RB, policy=pol, window=1)
        for _ in range(5):
            c.plan(np.array([1, 2]))
        c.plan(np.array([0]))  # cold, least used and least recent
        p = c.plan(np.array([0, 5]))
        assert c.contains(0), pol
        assert p.slots[0] >= 0 and p.overflow_units.size == 0


def test_deletion_moves_the_last_row_into_the_hole():
    c = UnitCache(8, 4, RB, policy="window", window=1)
    p = c.plan(np.array([0, 1, 2, 3]))
    write_misses(c, p)
    assert p.miss_slots.tolist() == [0, 1, 2, 3]
    p = c.plan(np.array([3, 6]))  # delete 0, 1, 2; 3 moves from slot 3 to slot 0
    assert p.evicted == 3 and p.moved_rows == 1 and p.moved_bytes == RB
    assert c.slots_of([3]).tolist() == [0]
    assert p.miss_units.tolist() == [6] and p.miss_slots.tolist() == [1]
    assert p.slots.tolist() == [0, 1]
    write_misses(c, p)
    assert np.array_equal(c.host[0], pattern_np([3], RB)[0])
    check_rows(c)
    assert c.stats.moved_rows == 1 and c.stats.evicted == 3


def test_deleting_the_tail_moves_nothing():
    c = UnitCache(8, 4, RB, policy="window", window=1)
    write_misses(c, c.plan(np.array([0, 1, 2, 3])))
    p = c.plan(np.array([0, 1]))
    assert p.evicted == 2 and p.moved_rows == 0 and c.num_used == 2


def test_overflow_exactly_when_active_exceeds_capacity():
    for pol in POLICIES:
        c = UnitCache(10, 3, RB, policy=pol)
        p = c.plan(np.array([0, 1, 2]))
        assert p.overflow_units.size == 0
        p = c.plan(np.array([4, 5, 6, 7]))
        assert p.overflow_units.tolist() == [7]  # no scores: highest ids overflow
        assert p.slots[-1] == -1 and (p.slots[:3] >= 0).all()
        assert cached_set(c) == {4, 5, 6}


def test_overflow_keeps_the_highest_scored_misses():
    c = UnitCache(10, 2, RB, policy="lfu")
    c.plan(np.array([3]))
    p = c.plan(np.array([0, 1, 3]), scores=np.array([0.1, 5.0, 0.0]))
    # 3 is a hit (kept whatever its score); one slot left: 1 beats 0
    assert cached_set(c) == {1, 3} and p.overflow_units.tolist() == [0]
    # scores given per neuron ([n_neurons]) work too
    full = np.zeros(10)
    full[[5, 6, 7]] = [1.0, 3.0, 2.0]
    p = c.plan(np.array([5, 6, 7]), scores=full)
    assert cached_set(c) == {6, 7} and p.overflow_units.tolist() == [5]
    with pytest.raises(ValueError):
        c.plan(np.array([5, 6, 7, 8]), scores=np.zeros(3))


def test_capacity_zero_everything_overflows():
    for pol in POLICIES:
        c = UnitCache(6, 0, RB, policy=pol)
        assert c.rows.shape == (0, RB) and c.host.shape == (0, RB)
        for active in ([0, 1, 2], [], [5], [0, 1, 2, 3, 4, 5]):
            p = c.plan(np.array(active, dtype=np.int64))
            assert p.overflow_units.tolist() == active
            assert (p.slots == -1).all() and p.miss_units.size == 0 and p.evicted == 0
            check_maps(c)
        assert c.stats.overflow == 10 and c.stats.read_bytes == 10 * RB


def test_empty_active_set():
    c = UnitCache(6, 3, RB, policy="window", window=1)
    c.plan(np.array([1, 2]))
    p = c.plan(np.array([], dtype=np.int64))
    assert p.slots.size == 0 and p.evicted == 2 and c.num_used == 0


def test_capacity_above_n_neurons_is_clipped():
    c = UnitCache(5, 100, RB)
    assert c.capacity == 5 and c.rows.shape == (5, RB)


def test_invalid_arguments():
    with pytest.raises(ValueError):
        UnitCache(4, 2, 1000)  # not a multiple of the alignment
    with pytest.raises(ValueError):
        UnitCache(4, 2, RB, policy="fifo")
    with pytest.raises(ValueError):
        UnitCache(4, 2, RB, window=0)
    with pytest.raises(ValueError):
        UnitCache(4, 2, RB, alignment=3000)
    c = UnitCache(4, 2, RB)
    for bad in ([2, 1], [1, 1], [-1], [4], [[1]], [0.5]):
        with pytest.raises(ValueError):
            c.plan(np.array(bad))
    assert c.step == 0 and c.num_used == 0  # a rejected plan changes nothing


# ----------------------------------------------------------------------------- memory


@pytest.mark.parametrize("cap", [1, 3, 17])
def test_row0_is_aligned_and_views_share_the_buffer(cap):
    c = UnitCache(32, cap, 2 * RB)
    whole = np.asarray(memoryview(c.buffer))
    base = whole.__array_interface__["data"][0]
    assert c.buffer.nbytes == cap * 2 * RB + 4096
    assert (base + c.base_offset) % 4096 == 0
    assert c.row_address(0) == base + c.base_offset
    assert all(c.row_address(s) % 4096 == 0 for s in range(cap))
    rows_np = np.asarray(memoryview(c.rows))
    assert rows_np.__array_interface__["data"][0] == base + c.base_offset, "rows must be a view, not a copy"
    assert np.shares_memory(c.host, whole)


def test_host_writes_are_visible_to_mlx_ops_on_rows():
    c = UnitCache(8, 4, RB)
    c.host[2] = 3
    c.host[2, :8] = np.arange(8, dtype=np.uint8)
    assert mx.sum(c.rows[2].astype(mx.int64)).item() == 3 * (RB - 8) + sum(range(8))
    assert mx.sum(c.rows[1].astype(mx.int64)).item() == 0
    # reinterpreted as weights, as the FFN does
    w = np.linspace(-1, 1, RB // 2, dtype=np.float16)
    c.host[1] = w.view(np.uint8)
    got = np.array(c.rows.view(mx.float16)[1])
    assert np.array_equal(got, w)
    # and a write after an MLX op has already read the row is seen by the next op
    before = mx.max(c.rows[3]).item()
    c.host[3, 100] = 200
    assert before == 0 and mx.max(c.rows[3]).item() == 200


def test_writes_through_memoryview_of_buffer_land_in_the_slot():
    """The pread pool writes row s at base_offset + s * row_bytes of memoryview(buffer)."""
    c = UnitCache(8, 4, RB)
    p = c.plan(np.array([2, 5, 7]))
    mv = memoryview(c.buffer).cast("B")
    for x, s in zip(p.miss_units, p.miss_slots):
        off = c.base_offset + int(s) * RB
        mv[off : off + RB] = pattern_np([x], RB)[0].tobytes()
    check_rows(c)


def test_native_pread_pool_writes_into_cache_rows(tmp_path):
    pp = pytest.importorskip("mlx_flash._pread_pool")
    n, rb = 12, 2 * RB
    path = os.path.join(tmp_path, "ffn.bin")
    pattern_np(np.arange(n), rb).tofile(path)
    c = UnitCache(n, 5, rb, policy="lru")
    try:
        pool = pp.Pool(path, threads=2)
    except OSError as e:  # a file system without O_DIRECT
        pytest.skip(str(e))
    with pool:
        for active in ([1, 2, 3], [3, 4, 9, 10], [0, 1, 2, 3, 4, 5, 6], [9, 11]):
            p = c.plan(np.array(active))
            m = p.miss_units.astype(np.int64)
            pool.read(
                memoryview(c.buffer),
                m * rb,
                np.full(m.size, rb, np.int64),
                c.base_offset + p.miss_slots.astype(np.int64) * rb,
            )
            check_maps(c)
            check_rows(c)


# ----------------------------------------------------------------------------- DIP-CA and budget


def test_cache_aware_scores_prefer_cached_on_equal_magnitude():
    x = np.ones(8, dtype=np.float32)
    cached = np.array([0, 1, 0, 1, 0, 1, 0, 0], dtype=bool)
    s = cache_aware_scores(x, cached, gamma=0.2)
    top3 = set(np.argsort(-s, kind="stable")[:3].tolist())
    assert top3 == {1, 3, 5}
    assert np.allclose(s, np.where(cached, 1.0, 0.2))
    sm = cache_aware_scores(mx.array(x), mx.array(cached), gamma=0.2)
    assert np.allclose(np.array(sm), s)


def test_cache_aware_scores_formula_and_gamma_one():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 50)).astype(np.float32)
    cached = rng.random(50) < 0.5
    a = np.abs(x)
    ref = a * (cached + 0.3 * (1 - cached)) / a.max(axis=-1, keepdims=True)
    assert np.allclose(cache_aware_scores(x, cached, 0.3), ref, rtol=1e-6)
    assert np.allclose(cache_aware_scores(a, cached, 1.0), a / a.max(axis=-1, keepdims=True), rtol=1e-6)
    got_mx = cache_aware_scores(mx.array(x), cached, 0.3)
    assert isinstance(got_mx, mx.array)
    assert np.allclose(np.array(got_mx), ref, rtol=1e-5)
    # a strong non-cached activation still beats a weak cached one
    s = cache_aware_scores(np.array([10.0, 1.0]), np.array([False, True]), 0.2)
    assert s[0] > s[1]
    # all-zero input: zeros, no NaN
    assert np.array_equal(cache_aware_scores(np.zeros(4), np.ones(4, bool)), np.zeros(4))
    assert np.array_equal(np.array(cache_aware_scores(mx.zeros((4,)), np.ones(4, bool))), np.zeros(4))


def test_cache_aware_scores_with_a_live_cache_mask():
    c = UnitCache(6, 3, RB)
    c.plan(np.array([4, 5]))
    s = cache_aware_scores(np.ones(6), c.cached_mask())
    assert set(np.argsort(-s, kind="stable")[:2].tolist()) == {4, 5}


def test_capacity_for_budget():
    assert capacity_for_budget(0, RB) == 0
    assert capacity_for_budget(RB - 1, RB) == 0
    assert capacity_for_budget(RB, RB) == 1
    assert capacity_for_budget(10 * RB + RB - 1, RB) == 10
    assert capacity_for_budget(3 << 30, 3 * 4096) == (3 << 30) // (3 * 4096)
    with pytest.raises(ValueError):
        capacity_for_budget(RB, 0)
    with pytest.raises(ValueError):
        capacity_for_budget(-1, RB)


@SETTINGS
@given(scenarios())
def test_in_place_decides_as_compact_and_copies_no_row(sc):
    """compact=False (what the engines use): the same hits, misses, overflow and evictions as the paper's compact
    cache, no row moved, a cached unit keeps its slot until evicted, and every cached unit's row holds its bytes."""
    n, cap, pol, window, steps = sc
    compact = UnitCache(n, cap, RB, policy=pol, window=window)
    in_place = UnitCache(n, cap, RB, policy=pol, window=window, compact=False)
    for active, scores in steps:
        active = np.asarray(active, dtype=np.int64)
        slots_before = in_place.unit_to_slot.copy()
        a, b = compact.plan(active, scores), in_place.plan(active, scores)
        write_misses(compact, a)
        write_misses(in_place, b)
        assert np.array_equal(a.miss_units, b.miss_units) and np.array_equal(a.overflow_units, b.overflow_units)
        assert a.evicted == b.evicted and a.hits == b.hits and b.moved_rows == 0
        assert np.array_equal(compact.cached_mask(), in_place.cached_mask())
        kept = (slots_before >= 0) & (in_place.unit_to_slot >= 0)
        assert np.array_equal(slots_before[kept], in_place.unit_to_slot[kept]), "a cached unit moved"
        used = np.flatnonzero(in_place.slot_to_unit >= 0)
        assert used.size == in_place.num_used
        assert np.array_equal(in_place.unit_to_slot[in_place.slot_to_unit[used]], used), "maps are not inverse"
        units = in_place.slot_to_unit[used]
        assert np.array_equal(in_place.host[used], pattern_np(units, RB)), "row content lost its unit"
        assert np.array_equal(np.sort(in_place.cached_units()), np.sort(compact.cached_units()))


def test_bypassed_misses_overflow_without_admission_or_eviction():
    """Units the caller holds elsewhere (read ahead) are neither admitted nor evict anything; hits stay hits."""
    cache = UnitCache(10, 3, RB, policy="lru", compact=False)
    write_misses(cache, cache.plan(np.array([0, 1, 2])))
    plan = cache.plan(np.array([1, 5, 7]), bypass=np.array([5, 9]))
    assert plan.overflow_units.tolist() == [5] and plan.miss_units.tolist() == [7]
    assert plan.evicted == 1 and cached_set(cache) == {1, 2, 7}  # 7 took the least recent (lowest id): 0
    assert plan.slots[1] == -1 and not cache.contains(5)
    plan = cache.plan(np.array([5]), bypass=np.array([5]))
    assert plan.overflow_units.tolist() == [5] and plan.evicted == 0 and cache.num_used == 3


@pytest.mark.parametrize("pol", ["lru", "lfu", "window"])
def test_units_admitted_ahead_take_slots_in_place_and_go_first(pol):
    """admit() (a read ahead into the cache) takes free slots, then the policy's victims but never one of `keep`;
    an admitted unit the next step does not use is the first to go, one it uses is a hit."""
    cache = UnitCache(10, 4, RB, policy=pol, compact=False)
    write_misses(cache, cache.plan(np.array([0, 1, 2])))
    write_misses(cache, cache.plan(np.array([0, 1])))  # 2 is now the least recent, 0 and 1 the most
    units, slots = cache.admit(np.array([6, 5, 8]), keep=np.array([0, 2]))  # the most wanted first
    assert units.tolist() == [6, 5] and cached_set(cache) == {0, 2, 5, 6}  # a free slot, then 1's: 8 has none
    assert np.array_equal(cache.slots_of(units), slots) and cache.stats.evicted == 1
    units, slots = cache.admit(np.array([9]), keep=np.array([0, 2, 5, 6]))
    assert len(units) == len(slots) == 0 and cache.num_used == 4  # nothing may go
    plan = cache.plan(np.array([0, 2, 6]))
    assert plan.miss_units.size == 0 and plan.hits == 3  # 6, admitted ahead: a hit
    plan = cache.plan(np.array([3]))  # 5 was admitted and never used: it goes first
    assert plan.miss_units.tolist() == [3] and cached_set(cache) == {0, 2, 3, 6}
    used = np.flatnonzero(cache.slot_to_unit >= 0)
    assert used.size == cache.num_used and np.array_equal(cache.unit_to_slot[cache.slot_to_unit[used]], used)
    with pytest.raises(ValueError, match="in place"):
        UnitCache(10, 4, RB).admit(np.array([1]))
