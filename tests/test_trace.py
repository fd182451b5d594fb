"""Selector traces: a sketch trace holds the calibrated sketch's own selections and its DRAM per
gate/up weight; replayed on another model it counts that DRAM there."""

import sys

import numpy as np
import pytest

from mlx_flash.calibrate import main as calibrate_main
from mlx_flash.convert import convert
from mlx_flash.flash_format import FlashDir
from mlx_flash.loader import make_sparsifier
from mlx_flash.quality import collect_inputs, eval_model
from mlx_flash.trace import Trace, TraceSparsifier, describe_selector, gate_up_weights, record

TEXT = "The quick brown fox jumps over the lazy dog. " * 40


@pytest.fixture(scope="module")
def sketched(tiny):
    """A tiny flash directory calibrated with a 2-bit sketch at MLP density 0.5."""
    root, src, data = tiny
    path = convert(str(src), root / "sketched", alignment=512, progress=False)
    argv = sys.argv
    sys.argv = ["calibrate", "--model", str(path), "--data", str(data), "--seq-len", "32", "--num-seqs", "2",
                "--selector-seqs", "1", "--selector", "sketch", "--sketch-bits", "2", "--max-ppl-increase", "10",
                "--quiet"]
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
    agree = [np.array_equal(sp.select(layer, x[t]), sketch_trace.ids(t, layer))
             for layer, x in enumerate(xs) for t in range(sketch_trace.n_tokens)]
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
    assert TraceSparsifier(sketch_trace, 2, fd.ffn["intermediate_size"], weights=gate_up_weights(fd)).nbytes == sp.nbytes
    per_weight = sketch_trace.meta["selector"]["bytes_per_weight"]
    # a LLaMA-7B shape: 32 layers of gate and up, 4096 x 11008
    big = TraceSparsifier(sketch_trace, 32, 11008, weights=32 * 2 * 4096 * 11008)
    assert big.nbytes == round(per_weight * 32 * 2 * 4096 * 11008)
    # the oracle's trace is the upper bound: no DRAM counted, and labelled so
    oracle = Trace(sketch_trace.active, meta={"sparsity": "oracle", "selector": {"name": "oracle", "upper_bound": True}})
    assert TraceSparsifier(oracle, 32, 11008, weights=32 * 2 * 4096 * 11008).nbytes == 0
    assert describe_selector(oracle.meta) == describe_selector({"sparsity": "oracle"}) == "oracle (upper bound, not deployable)"
