"""Selectors pick the true top-K on constructed cases, their DRAM is in the budget plan, a directory
ships one calibrated selector (others refused, "auto" checks its measured perplexity increase)."""

import sys

import mlx.core as mx
import numpy as np
import pytest

from mlx_flash import FlashError
from mlx_flash.calib.calibrate import main as calibrate_main
from mlx_flash.convert import convert
from mlx_flash.flash_format import FlashDir
from mlx_flash.budget import min_budget, min_streaming_budget
from mlx_flash.loader import cpu_cast, load, make_sparsifier
from mlx_flash.offload import stream_groups
from mlx_flash.calib.quality import dense_ffn_weights, eval_model
from mlx_flash.selectors import build_sketch, dequantized_sketch, save_selector
from mlx_flash.sparsity import WINA, Dense, Predictor, Sketch, top_k

def _flash(tiny, name, layout="neurons"):
    root, src, _ = tiny
    return convert(str(src), root / name, layout=layout, alignment=512, progress=False)


def _calibrate(path, data, *extra):
    argv = sys.argv
    sys.argv = ["calibrate", "--model", str(path), "--data", str(data), "--seq-len", "32", "--num-seqs", "2",
                "--dip-seqs", "1", "--selector-seqs", "1", "--dip-candidates", "2", "--quiet", *extra]
    try:
        calibrate_main()
    finally:
        sys.argv = argv


# -- each selector picks the true top-K on a constructed case ------------------------------------------
def test_sketch_picks_the_true_top_k():
    """Neuron i sees only input i (one non-zero per row: even a 2-bit copy is within a few %): |act(g) u| is
    known, and the sketch's top-K is exactly the top-K of the true GLU, also with input scaling."""
    n = d = 64
    rng = np.random.default_rng(0)
    a, b = rng.uniform(0.5, 2, n), rng.uniform(0.5, 2, n) * rng.choice([-1, 1], n)
    w = {"gate": mx.array(np.diag(a).astype(np.float32)), "up": mx.array(np.diag(b).astype(np.float32))}
    x = rng.uniform(0.2, 1, d).astype(np.float32)
    g, u = a * x, b * x
    true = np.abs(g / (1 + np.exp(-g)) * u)
    xs = [rng.normal(size=(16, d)).astype(np.float32)]
    for bits, calib in ((2, None), (4, xs)):
        sk = Sketch(build_sketch([w], calib, bits, 32), "silu", bits, 32, [0.25])
        assert sk.select(0, x).tolist() == top_k(true, 16).tolist()
        assert np.allclose(np.array(sk.estimate(0, mx.array(x))), true, rtol=0.05)
        est = dequantized_sketch(sk.layers, bits, 32)[0]  # what the quality Controller uses
        assert np.allclose(np.array(est["gate"]), np.diag(a), atol=1e-3)


def test_wina_scales_scores_by_weight_norms():
    """|x| alone prefers input 1 and neuron 0; the weight norms turn both choices around."""
    sp = WINA([0.5], [0.5], [np.array([3.0, 1.0], np.float32)], [np.array([1.0, 4.0], np.float32)])
    assert sp.select_inputs(0, np.array([1.0, 2.0], np.float32)).tolist() == [0]
    assert sp.select_neurons(0, np.array([-2.0, 1.0], np.float32)).tolist() == [1]
    assert sp.name == "wina" and sp.nbytes == 16


def test_predictor_top_k_and_dense_on_every_layout():
    w = [{"A": mx.eye(3), "B": mx.array(np.array([[1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 1, 0]], np.float32))}]
    x = np.array([0.1, -1.0, 2.0], np.float32)  # logits 0.1, -1, 2, -0.9
    assert Predictor(w, density=0.5).select(0, x).tolist() == [0, 2]
    dense = Dense(4)
    assert dense.select_inputs(0, x).tolist() == [0, 1, 2] and dense.select_neurons(0, x).tolist() == [0, 1, 2, 3]


# -- a directory ships one selector ---------------------------------------------------------------
def _tight(fd):
    """A budget with room for the sketch and a tenth of the FFN's units."""
    return min_budget(fd, 64, resident=fd.resident_nbytes(cpu_cast)) + fd.manifest["sparsity"]["selector"]["nbytes"] + (
        fd.ffn_bytes // 10)


def test_calibrated_sketch_is_used_by_auto_with_its_dram_in_the_plan(tiny):
    _, _, data = tiny
    path = _flash(tiny, "sketch")
    _calibrate(path, data, "--max-ppl-increase", "10")
    fd = FlashDir(path)
    sel = fd.manifest["sparsity"]["selector"]
    assert sel["name"] == "sketch" and sel["bits"] == 2 and np.isfinite(sel["ppl_increase"])
    sp = make_sparsifier(fd, "auto", max_ppl_increase=10)
    assert isinstance(sp, Sketch) and sp.nbytes == sel["nbytes"] > 0
    # the controller's float32 copy of the saved sketch gives the perplexity calibration recorded
    model, ctl = eval_model(fd)
    ctl.set_mode("sketch", sketch=dequantized_sketch(sp.layers, sp.bits, sp.group_size), neuron_density=sp.density)
    assert sel["held_out_tokens"] == 32
    # few units cached, and the sketch sparse enough that the gaps the pool fills between its units do not make up
    # a whole layer: it reads fewer bytes than dense, with its DRAM in the plan
    model_, tok = load(path, memory_budget=_tight(fd), sparsity="auto", density=0.02, max_ppl_increase=10, context=64)
    try:
        assert model_.flash.plan.extra == model_.flash.sparsifier.nbytes == sel["nbytes"]
        assert model_.flash.sparsifier.name == "sketch" and model_.flash.why.startswith("auto: sketch")
    finally:
        model_.flash.close()
    model_, tok = load(path, sparsity="auto", max_ppl_increase=10, context=64)
    try:  # every unit cached: nothing to save, and the sketch's DRAM would be spent for nothing
        assert model_.flash.sparsifier.name == "dense" and model_.flash.plan.extra == 0
        assert model_.flash.why.startswith("auto: dense, since the calibrated sketch would read")
    finally:
        model_.flash.close()
    floor = min_streaming_budget(fd, 64, resident=fd.resident_nbytes(cpu_cast), groups=stream_groups(fd, cpu_cast, 64))
    model_, tok = load(path, memory_budget=floor + sel["nbytes"] // 2, sparsity="auto", max_ppl_increase=10, context=64)
    try:  # room for dense, not for the sketch's DRAM: dense, and why (no BudgetError)
        assert model_.flash.sparsifier.name == "dense" and "does not fit this budget" in model_.flash.why
    finally:
        model_.flash.close()
    # a measured increase above what the user allows: auto falls back to dense
    assert isinstance(make_sparsifier(fd, "auto", max_ppl_increase=sel["ppl_increase"] - 1e-6), Dense)
    assert isinstance(make_sparsifier(fd, "auto", max_ppl_increase=sel["ppl_increase"] + 1e-6), Sketch)
    # another lossy selector is refused with a clear error; the lossless ones always serve
    with pytest.raises(FlashError, match="calibrated for --sparsity sketch, not predictor"):
        make_sparsifier(fd, "predictor")
    assert make_sparsifier(fd, "dense").name == "dense" and make_sparsifier(fd, "oracle").name == "oracle"


def test_sketch_selection_in_runtime_equals_controller(tiny):
    """The runtime's quantised sketch and the controller's dequantised copy choose the same neurons."""
    path = _flash(tiny, "same")
    fd = FlashDir(path)
    w = [dense_ffn_weights(fd, i) for i in range(len(fd.layers))]
    arrays = build_sketch(w, None, 3, 32)
    sp = Sketch(arrays, "silu", 3, 32, [0.5] * len(w))
    deq = dequantized_sketch(arrays, 3, 32)
    x = np.random.default_rng(3).normal(size=fd.ffn["hidden_size"]).astype(np.float32)
    for i in range(len(w)):
        s = np.abs(np.array(mx.sigmoid(mx.array(x) @ deq[i]["gate"].T) * (mx.array(x) @ deq[i]["gate"].T)
                            * (mx.array(x) @ deq[i]["up"].T)))
        # MLX's CPU quantised matmul rounds differently (~1e-3 relative): near-ties may swap at the boundary
        assert np.allclose(np.array(sp.estimate(i, mx.array(x)[None]))[0], s, rtol=2e-2, atol=1e-3)
        a, b = set(sp.select(i, x).tolist()), set(top_k(s, round(0.5 * len(s))).tolist())
        assert len(a) == len(b) and len(a ^ b) <= 0.1 * len(a)


def test_wina_on_the_dip_layout(tiny):
    _, _, data = tiny
    path = _flash(tiny, "dip", layout="dip")
    _calibrate(path, data, "--selector", "wina")
    fd = FlashDir(path)
    sel = fd.manifest["sparsity"]["selector"]
    assert sel["name"] == "wina" and len(sel["input_density"]) == len(fd.layers)
    model, _ = load(path, sparsity="wina", context=64)
    try:
        sp = model.flash.sparsifier
        assert isinstance(sp, WINA) and model.flash.plan.extra == sp.nbytes > 0
        list(__import__("mlx_lm.generate", fromlist=["generate_step"]).generate_step(mx.array([1, 2, 3]), model, max_tokens=3))
    finally:
        model.flash.close()
    with pytest.raises(FlashError, match="calibrated for --sparsity wina, not dip"):
        make_sparsifier(fd, "dip")


def test_uncalibrated_and_unmeasured_directories_run_dense(tiny):
    path = _flash(tiny, "plain")
    fd = FlashDir(path)
    assert isinstance(make_sparsifier(fd, "auto"), Dense)
    with pytest.raises(FlashError, match="has no sketch"):
        make_sparsifier(fd, "sketch")
    save_selector(fd, "sketch", None, bits=2, group_size=32, density=[0.5] * len(fd.layers))  # no measurement
    assert isinstance(make_sparsifier(FlashDir(path), "auto"), Dense)


def test_generate_stats_name_the_selector(tiny):
    import subprocess

    _, _, data = tiny
    path = _flash(tiny, "gen")
    _calibrate(path, data, "--max-ppl-increase", "10")
    nbytes = FlashDir(path).manifest["sparsity"]["selector"]["nbytes"]
    run = [sys.executable, "-m", "mlx_flash.generate", "--model", str(path), "--prompt", "hello", "--max-tokens", "3",
           "--stats", "--max-ppl-increase"]
    tight = ["--memory-budget", str(_tight(FlashDir(path))), "--density", "0.02"]
    r = subprocess.run(run + ["10"] + tight, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "selector: sketch 2-bit gate/up" in r.stdout and f"extra {nbytes / 1024:.1f} KiB" in r.stdout
    assert "auto: sketch" in r.stdout
    r = subprocess.run(run + ["-1"] + tight, capture_output=True, text=True, timeout=300)  # nothing is good enough
    assert r.returncode == 0, r.stderr
    assert "selector: dense" in r.stdout
    r = subprocess.run(run + ["10", "--memory-budget", "250%"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr  # all cached: the sketch would save no read
    assert "selector: dense" in r.stdout and "auto: dense, since the calibrated sketch would read" in r.stdout


def test_candidates_follow_the_layout():
    from mlx_flash.calib.calibrate import selector_candidates

    assert [c["bits"] for c in selector_candidates("neurons")] == [2, 3, 4]  # cheapest DRAM first
    assert [c["bits"] for c in selector_candidates("neurons", sketch_bits=[4, 3])] == [3, 4]  # --sketch-bits
    assert [c["name"] for c in selector_candidates("dip")] == ["dip", "wina"]
    with pytest.raises(ValueError, match="does not serve the dip layout"):
        selector_candidates("dip", "sketch")
