"""Selector traces: a sketch trace holds the calibrated sketch's own selections and its DRAM per
gate/up weight; replayed on another model it counts that DRAM there, in the budget plan and the bench."""

import sys

from mlx_flash import BudgetError, bench
from mlx_flash.budget import min_budget, min_streaming_budget, plan_memory
from mlx_flash.calib.quality import collect_inputs, eval_model
from mlx_flash.calib.trace import Trace, TraceSparsifier, default_trace, describe_selector, gate_up_weights, record
from mlx_flash.calibrate import main as calibrate_main
from mlx_flash.convert import convert
from mlx_flash.engine.resident import stream_groups
from mlx_flash.engine.sparsity import dram_bytes
from mlx_flash.format.directory import FlashDir
from mlx_flash.loader import cpu_cast, kv_size_of, make_sparsifier
from mlx_flash.models.inspect import instantiate

import numpy as np
import pytest

TEXT = "The quick brown fox jumps over the lazy dog. " * 40
CONTEXT = 8 + 6 + 8  # the bench's prompt + tokens + 8


@pytest.fixture(scope="module")
def sketched(tiny):
    """A tiny flash directory calibrated with a 2-bit sketch at MLP density 0.5."""
    root, src, data = tiny
    path = convert(str(src), root / "sketched", alignment=512, progress=False)
    argv = sys.argv
    sys.argv = [
        "calibrate",
        "--model",
        str(path),
        "--data",
        str(data),
        "--seq-len",
        "32",
        "--num-seqs",
        "2",
        "--selector-seqs",
        "1",
        "--selector",
        "sketch",
        "--sketch-bits",
        "2",
        "--max-ppl-increase",
        "10",
        "--quiet",
    ]
    try:
        calibrate_main()
    finally:
        sys.argv = argv
    return path


@pytest.fixture(scope="module")
def sketch_trace(sketched, tmp_path_factory):
    tr = record(sketched, "sketch", 0.5, tokens=24, text=TEXT)
    return Trace.load(tr.save(tmp_path_factory.mktemp("trace") / "sketch.npz"))


def test_sketch_trace_holds_the_sketchs_own_selections(sketched, sketch_trace):
    fd = FlashDir(sketched)
    sp = make_sparsifier(fd, "sketch", 0.5)
    # the FFN inputs from another forward pass (quality.py's), handed to the sketch one token at a time
    model, ctl = eval_model(fd)
    xs = collect_inputs(model, ctl, np.array([list(sketch_trace.tokens) + [0]]))
    agree = [
        np.array_equal(sp.select(layer, x[t]), sketch_trace.ids(t, layer))
        for layer, x in enumerate(xs)
        for t in range(sketch_trace.n_tokens)
    ]
    assert np.mean(agree) >= 0.95  # another model's float rounding may swap a near-tie at the boundary
    assert sketch_trace.density() == pytest.approx(0.5, abs=0.01)
    sel = sketch_trace.meta["selector"]
    assert (sel["name"], sel["bits"], sel["group_size"], sel["nbytes"]) == ("sketch", 2, 64, sp.nbytes)
    assert sel["bytes_per_weight"] * gate_up_weights(fd) == pytest.approx(sp.nbytes)
    assert describe_selector(sketch_trace.meta).startswith("sketch 2-bit (group 64")


def test_replayed_selector_dram_scales_with_the_targets_gate_up(sketched, sketch_trace):
    fd = FlashDir(sketched)
    sp = make_sparsifier(fd, "sketch", 0.5)
    assert TraceSparsifier(sketch_trace).nbytes == sp.nbytes  # its own model: the sketch's own DRAM
    assert (
        TraceSparsifier(sketch_trace, 2, fd.ffn["intermediate_size"], weights=gate_up_weights(fd)).nbytes == sp.nbytes
    )
    per_weight = sketch_trace.meta["selector"]["bytes_per_weight"]
    # a LLaMA-7B shape: 32 layers of gate and up, 4096 x 11008
    big = TraceSparsifier(sketch_trace, 32, 11008, weights=32 * 2 * 4096 * 11008)
    assert big.nbytes == round(per_weight * 32 * 2 * 4096 * 11008)
    # the oracle's trace is the upper bound: no DRAM counted, and labelled so
    oracle = Trace(
        sketch_trace.active, meta={"sparsity": "oracle", "selector": {"name": "oracle", "upper_bound": True}}
    )
    assert TraceSparsifier(oracle, 32, 11008, weights=32 * 2 * 4096 * 11008).nbytes == 0
    assert (
        describe_selector(oracle.meta)
        == describe_selector({"sparsity": "oracle"})
        == "oracle (upper bound, not deployable)"
    )


def test_the_plan_holds_the_replayed_selector_or_refuses_the_budget(tiny, sketch_trace):
    root, src, _ = tiny
    fd = FlashDir(convert(str(src), root / "target", alignment=512, progress=False))
    sp, desc = bench.choose_sparsifier(fd, 0.5, (sketch_trace, "sketch.npz"))
    assert sp.nbytes > 0 and dram_bytes(sp) == sp.nbytes and "sketch 2-bit" in desc
    resident, groups = bench.resident_bytes(fd), stream_groups(fd, instantiate(fd.config), cpu_cast, CONTEXT)
    budget = min_budget(fd, CONTEXT, kv_size_of(fd), resident=resident) + fd.ffn_bytes // 2
    without = plan_memory(fd, budget, CONTEXT, kv_size_of(fd), 0, resident=resident, groups=groups)
    plan = plan_memory(fd, budget, CONTEXT, kv_size_of(fd), sp.nbytes, resident=resident, groups=groups)
    strides = {k: v.stride for k, v in fd.layouts.items()}
    assert plan.extra == sp.nbytes and plan.cache_bytes(strides) < without.cache_bytes(strides)
    # a budget that loads dense (everything streamed) but not with the selector
    lowest = min_streaming_budget(fd, CONTEXT, kv_size_of(fd), resident=resident, groups=groups)
    with pytest.raises(BudgetError, match="too small"):
        plan_memory(fd, lowest + sp.nbytes // 2, CONTEXT, kv_size_of(fd), sp.nbytes, resident=resident, groups=groups)
    # the bench says so: dense rows run, the selector's rows are skipped with the reason
    res = bench.run(
        fd.path,
        lowest + sp.nbytes // 2,
        tokens=6,
        prompt_tokens=8,
        configs=("hybrid", "all"),
        trace=(sketch_trace, "sketch.npz"),
        disk_seconds=0.05,
        use_fio=False,
        progress=False,
    )
    assert res["configs"]["hybrid"]["bytes_per_token"] > 0
    assert "selector's DRAM" in res["configs"]["all"]["skipped"] and "does not fit" in res["configs"]["all"]["skipped"]
    assert "all" not in res["targets"] and "io_bytes_all_over_dense" not in res["targets"]


def test_bench_streams_what_the_selector_pushes_out(tiny, sketch_trace):
    """Just above the resident floor: dense keeps every attention layer; with the selector's DRAM the plan
    streams attention layers, and the sparse rows run on a model that streams them (reloaded)."""
    root, _, _ = tiny
    fd = FlashDir(root / "target")
    sp = bench.choose_sparsifier(fd, 0.5, (sketch_trace, "sketch.npz"))[0]
    budget = min_budget(fd, CONTEXT, kv_size_of(fd), resident=bench.resident_bytes(fd))
    layers = [
        sum(g.kind == "layer" for g in bench.engine_plan(fd, budget, CONTEXT, e).streamed) for e in (0, sp.nbytes)
    ]
    assert layers[0] == 0 < layers[1]  # the case: the selector's DRAM pushes attention layers out
    res = bench.run(
        fd.path,
        budget,
        tokens=6,
        prompt_tokens=8,
        configs=("hybrid", "all", "sparsity"),
        trace=(sketch_trace, "sketch.npz"),
        disk_seconds=0.05,
        use_fio=False,
        progress=False,
    )
    hy, a = res["configs"]["hybrid"], res["configs"]["all"]
    assert hy["streamed_attention_layers"] == 0 and hy["selector_bytes"] == 0
    assert a["streamed_attention_layers"] > 0 and a["selector_bytes"] == sp.nbytes
    assert a["streamed_bytes_per_token"] > hy["streamed_bytes_per_token"]  # the layers are read every token
    assert a["dram_weights_bytes"] <= budget
    assert res["configs"]["sparsity"]["streamed"] == a["streamed"]
    assert res["targets"]["io_bytes_all_over_dense"] == a["bytes_per_token"] / hy["bytes_per_token"]


def test_default_trace_is_the_calibrated_sketchs(sketched, monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_FLASH_CACHE", str(tmp_path))
    tr, path = default_trace(0.5, tokens=16, model=sketched)
    assert path.name == "sketched-sketch2b-g64-0.5-16.npz" and path.parent == tmp_path / "traces"
    assert tr.meta["selector"]["name"] == "sketch" and tr.n_tokens == 16
    assert default_trace(0.5, tokens=16, model=sketched)[1] == path  # cached
