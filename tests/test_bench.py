"""Benchmark tooling: bench numbers are self-consistent, synthetic dirs have the requested shapes,
traces round-trip and replay exactly, the simulator's estimate for this machine is near the measured."""

import json
from types import SimpleNamespace

import mlx_flash  # noqa: F401
from mlx_flash import bench
from mlx_flash.calib.trace import MappedTrace, RecordingSparsifier, Trace, TraceSparsifier, record
from mlx_flash.convert import convert
from mlx_flash.format.directory import FlashDir
from mlx_flash.loader import kv_size_of, load
from mlx_flash.models.tiny import make_tiny_model_dir
from mlx_flash.tools import simulate, synthetic

import mlx.core as mx
import numpy as np
import pytest

TEXT = "The quick brown fox jumps over the lazy dog. " * 40


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    src = make_tiny_model_dir("llama", root / "src")
    return convert(str(src), root / "flash", alignment=512, progress=False)


@pytest.fixture(scope="module")
def tiny_trace(tiny_dir):
    return record(tiny_dir, "oracle", 0.25, tokens=48, text=TEXT)


@pytest.fixture(scope="module")
def bench_result(tiny_dir, tiny_trace, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_out")
    trace = tiny_trace.save(out / "trace.npz")
    fd = FlashDir(tiny_dir)
    # a budget whose caches hold about a third of the FFN
    budget = bench.min_budget(fd, 8 + 12 + 8, kv_size_of(fd), resident=bench.resident_bytes(fd)) + fd.ffn_bytes // 3
    argv = [
        "--model",
        str(tiny_dir),
        "--memory-budget",
        str(budget),
        "--tokens",
        "12",
        "--prompt-tokens",
        "8",
        "--quick",
        "--no-fio",
        "--trace",
        str(trace),
        "--json",
        str(out / "r.json"),
        "--plot",
        str(out / "r.png"),
    ]
    bench.main(argv)
    return json.loads((out / "r.json").read_text()), out


def test_bench_json_has_every_configuration_and_a_plot(bench_result):
    res, out = bench_result
    assert set(res["configs"]) == set(bench.CONFIGS)
    assert (out / "r.png").stat().st_size > 1000
    for name, r in res["configs"].items():
        assert r["total_ms"] > 0, name
        if name != "speculative":  # (its total is a mean per generated token, its percentiles per pass)
            assert r["total_ms_p10"] <= r["total_ms"] <= r["total_ms_p90"], name


def test_bench_bytes_are_misses_times_stride(bench_result, tiny_dir):
    res, _ = bench_result
    fd = FlashDir(tiny_dir)
    stride = fd.layouts["neurons"].stride
    for name, r in res["configs"].items():
        if name == "mlx-lm":
            continue
        assert r["bytes_requested_per_token"] == pytest.approx(r["misses_per_token"] * stride), name
        assert r["bytes_per_token"] >= r["bytes_requested_per_token"], name  # gaps and alignment on top
        assert r["reader_bytes_read"] >= r["bytes_per_token"] * r["tokens"]


def test_naive_reads_every_unit_and_the_others_read_less(bench_result, tiny_dir):
    res, _ = bench_result
    c = res["configs"]
    fd = FlashDir(tiny_dir)
    assert c["naive"]["bytes_per_token"] == fd.ffn_bytes
    assert c["naive"]["hit_rate"] == 0.0 and c["naive"]["cache_bytes"] == 0
    assert 0 < c["hybrid"]["bytes_per_token"] < c["naive"]["bytes_per_token"]
    assert c["sparsity"]["bytes_per_token"] < c["naive"]["bytes_per_token"]
    assert c["all"]["bytes_per_token"] < c["sparsity"]["bytes_per_token"]
    # unbundled asks for the same bytes in more, smaller requests (and fills no gaps at the device):
    # one per matrix per run of neighbours, while "all" reads a run (or several, across small gaps) at once
    u = c["window-unbundled"]
    pieces = min(len(fd.ffn["matrices"]), u["stride"] // fd.unit_alignment)  # each at least one unit alignment
    assert u["bytes_requested_per_token"] == c["all"]["bytes_requested_per_token"]
    assert u["bytes_per_token"] >= u["bytes_requested_per_token"]  # packed units: a piece reads the blocks it spans
    assert u["requests_per_token"] > c["all"]["requests_per_token"]
    assert u["requests_per_token"] < pieces * u["bytes_requested_per_token"] / u["stride"]  # neighbours merged
    assert c["hybrid"]["dram_weights_bytes"] <= res["budget_bytes"]
    assert c["hybrid-prefetch"]["dram_weights_bytes"] <= res["budget_bytes"]
    assert c["hybrid-prefetch"]["bytes_requested_per_token"] == pytest.approx(
        c["hybrid"]["bytes_requested_per_token"], rel=0.05
    )
    assert res["targets"]["io_bytes_naive_over_all"] > 1


def test_unbundled_reads_one_request_per_matrix_per_run_of_neighbours():
    stride = 48  # three 16-byte pieces at alignment 4
    units = np.array([6, 0, 1, 2, 5, 9])
    slots = np.array([5, 0, 1, 2, 3, 4])  # 0-2 neighbours in the file and in the cache; 5, 6 only in the file
    fd = SimpleNamespace(unit_alignment=4)
    o, ln, d = bench.UnbundledReader(None, fd, 3)._split(units * stride, np.full(6, stride), slots * stride, stride)
    assert ln.tolist() == [48] * 3 + [16] * 9  # runs 0-2, 5, 6, 9: one request per piece each
    file = np.arange(10 * stride)  # each "byte" its own offset
    got, want = np.full(6 * stride, -1), np.full(6 * stride, -1)
    for oi, li, di in zip(o, ln, d):
        got[di : di + li] = file[oi : oi + li]
    for u, s in zip(units, slots):
        want[s * stride : (s + 1) * stride] = file[u * stride : (u + 1) * stride]
    assert np.array_equal(got, want)


def test_synthetic_builder_makes_the_requested_shapes(tmp_path):
    path = synthetic.build("tiny", tmp_path / "tiny", progress=False)
    assert synthetic.build("tiny", tmp_path / "tiny", progress=False) == path  # cached: not rebuilt
    fd = FlashDir(path)
    cfg = synthetic.PRESETS["tiny"]
    assert len(fd.layers) == cfg["num_hidden_layers"]
    assert fd.ffn["intermediate_size"] == cfg["intermediate_size"] == fd.layers[0]["neurons"].n_units
    comps = {c.name: c for c in fd.layouts["neurons"].components}
    d = cfg["hidden_size"]
    assert comps["gate.weight"].shape == (d * 4 // 32,) and comps["down.weight"].shape == (d * 8 // 32,)
    model, _ = load(path, memory_budget=None, sparsity="dense", context=32)
    y = model(mx.array([[1, 2, 3]]))
    assert y.shape == (1, 3, cfg["vocab_size"]) and bool(mx.isfinite(y).all())
    model.flash.close()


def test_trace_round_trip_and_exact_replay(tiny_dir, tiny_trace, tmp_path):
    tr = tiny_trace
    assert tr.active.shape == (48, 2, FlashDir(tiny_dir).ffn["intermediate_size"])
    assert tr.density() == pytest.approx(0.25, abs=0.01)
    back = Trace.load(tr.save(tmp_path / "t.npz"))
    assert np.array_equal(back.active, tr.active) and back.meta == tr.meta

    # replay through the runtime: the engine asks for exactly the recorded sets, token by token
    model, _ = load(tiny_dir, memory_budget=None, sparsity="dense", context=64)
    rec = RecordingSparsifier(TraceSparsifier(back), 2, tr.n_units)
    model.flash.sparsifier = rec
    y = mx.array([[5]])
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    for _ in range(10):
        y = mx.argmax(model(y, cache=cache)[:, -1], axis=-1)[None]
        mx.eval(y)
    model.flash.close()
    replayed = rec.to_trace()
    assert np.array_equal(replayed.active, tr.active[:10])


def test_mapped_trace_keeps_density_and_reuse(tiny_trace):
    tr = tiny_trace
    m = MappedTrace(tr, n_layers=5, n_units=1000, seed=1)
    big = Trace(np.stack([np.stack([m.mask(t, l) for l in range(5)]) for t in range(tr.n_tokens)]))
    assert big.density() == pytest.approx(tr.density(), abs=0.02)
    assert big.reuse(1) == pytest.approx(tr.reuse(1), abs=0.05)
    # a fixed mapping: the same token and layer give the same set
    assert np.array_equal(m.ids(3, 4), m.ids(3, 4))
    assert list(m.layer_map) == [0, 0, 0, 1, 1]


def test_simulate_estimate_for_this_machine_within_factor(bench_result, tiny_trace):
    res, _ = bench_result
    sim = simulate.simulate(res, tiny_trace, ["this", "m1-max", "phone"])
    this = sim["machines"]["this"]["configs"]
    # the stated factor for the tiny model, where per-layer Python overheads dominate and the machine
    # may be shared (tokens of ~5 ms): 10x either way for the geometric mean over configurations
    # (SmolLM2 / 7B runs: 0.5-1.6x, BENCHMARKS.md)
    ratios = {name: e["ratio"] for name, e in this.items()}
    assert 1 / 10 < float(np.exp(np.mean(np.log(list(ratios.values()))))) < 10, ratios
    # a faster disk and DRAM give more tokens/s
    assert sim["machines"]["m1-max"]["configs"]["all"]["tokens_per_s"] > this["all"]["tokens_per_s"]
    # the cache simulation reads what the runtime read (the bench replayed the same trace)
    for name in ("naive", "hybrid", "sparsity", "all"):
        assert this[name]["bytes_per_token"] == pytest.approx(
            res["configs"][name]["bytes_requested_per_token"], rel=0.1
        ), name
        # and its model of coalescing gives the bytes read at the device
        assert this[name]["bytes_read_per_token"] == pytest.approx(res["configs"][name]["bytes_per_token"], rel=0.1), (
            name
        )


def test_bench_below_the_resident_floor(tiny_dir, tiny_trace, tmp_path):
    """A budget under the resident weights: every configuration streams the same attention / embedding
    groups, reports them per token, and naive reads the whole FFN on top."""
    from mlx_flash.budget import min_streaming_budget
    from mlx_flash.engine.resident import stream_groups
    from mlx_flash.loader import cpu_cast, kv_size_of
    from mlx_flash.models.inspect import instantiate

    fd = FlashDir(tiny_dir)
    context = 8 + 12 + 8
    lowest = min_streaming_budget(
        fd,
        context,
        kv_size_of(fd),
        resident=bench.resident_bytes(fd),
        groups=stream_groups(fd, instantiate(fd.config), cpu_cast, context),
    )
    res = bench.run(
        tiny_dir,
        lowest,
        tokens=12,
        prompt_tokens=8,
        configs=("naive", "all"),
        trace=(tiny_trace, "trace"),
        disk_seconds=0.1,
        use_fio=False,
        progress=False,
    )
    assert res["streamed"] and res["min_budget_bytes"] == lowest < res["resident_floor_bytes"]
    naive, all_ = res["configs"]["naive"], res["configs"]["all"]
    assert naive["streamed_bytes_per_token"] == all_["streamed_bytes_per_token"] > 0
    assert naive["bytes_per_token"] >= naive["streamed_bytes_per_token"] + fd.ffn_bytes * 0.99


def test_rounds_alternate_and_report_the_median_round(tiny_dir, tiny_trace):
    """--rounds 3: every flash configuration runs three times; each reports its median round, the
    hybrid/all ratio is the median of the per-round ratios."""
    fd = FlashDir(tiny_dir)
    budget = bench.min_budget(fd, 8 + 6 + 8, kv_size_of(fd), resident=bench.resident_bytes(fd)) + fd.ffn_bytes // 3
    res = bench.run(
        tiny_dir,
        budget,
        tokens=6,
        prompt_tokens=8,
        configs=("hybrid", "all"),
        trace=(tiny_trace, "trace"),
        disk_seconds=0.05,
        use_fio=False,
        progress=False,
        rounds=3,
    )
    hy, a = res["configs"]["hybrid"], res["configs"]["all"]
    for r in (hy, a):
        assert len(r["rounds_total_ms"]) == 3
        assert r["total_ms"] == sorted(r["rounds_total_ms"])[1]
    pairs = [h / x for h, x in zip(hy["rounds_total_ms"], a["rounds_total_ms"])]
    assert res["targets"]["latency_hybrid_over_all_rounds"] == pairs
    assert res["targets"]["latency_hybrid_over_all"] == pytest.approx(float(np.median(pairs)))


def test_the_oracle_stand_in_is_in_the_budget_as_load_counts_it(tiny_dir):
    """One budget rule: the live oracle's own copy of gate/up is in the bench's plan, as in load's."""
    fd = FlashDir(tiny_dir)
    res = bench.run(
        tiny_dir,
        4 * fd.model_bytes,
        tokens=3,
        prompt_tokens=4,
        configs=("all",),
        density=0.5,
        disk_seconds=0.05,
        use_fio=False,
        progress=False,
    )
    flash = load(tiny_dir, memory_budget=4 * fd.model_bytes, sparsity="oracle", density=0.5, context=16)[0].flash
    assert "oracle" in res["sparsifier"] and flash.sparsifier.nbytes > 0
    assert (
        res["selector_bytes"] == res["configs"]["all"]["selector_bytes"] == flash.plan.extra == flash.sparsifier.nbytes
    )
