"""Selectors pick the true top-K on constructed cases, their DRAM is in the budget plan, a directory
ships one calibrated selector (others refused, "auto" checks its measured perplexity increase)."""

import sys

from mlx_flash import FlashError
from mlx_flash.budget import min_budget, min_streaming_budget
from mlx_flash.calib.quality import dense_ffn_weights, eval_model, perplexity
from mlx_flash.calibrate import main as calibrate_main
from mlx_flash.convert import convert
from mlx_flash.default_model import default_model_dir
from mlx_flash.engine.resident import stream_groups
from mlx_flash.engine.selectors import build_sketch, save_selector, wina_norms
from mlx_flash.engine.sparsity import WINA, Dense, Predictor, Sketch, top_k
from mlx_flash.format.directory import FlashDir
from mlx_flash.loader import cpu_cast, kv_size_of, load, load_tokenizer, make_sparsifier
from mlx_flash.models.inspect import instantiate
from mlx_flash.texts import read_text, token_batches

import mlx.core as mx
import numpy as np
import pytest


def _flash(tiny, name, layout="neurons"):
    root, src, _ = tiny
    return convert(str(src), root / name, layout=layout, alignment=512, progress=False)


def _calibrate(path, data, *extra):
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
        "--dip-seqs",
        "1",
        "--selector-seqs",
        "1",
        "--dip-candidates",
        "2",
        "--quiet",
        *extra,
    ]
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
    return (
        min_budget(fd, 64, kv_size_of(fd), resident=fd.resident_nbytes(cpu_cast))
        + fd.manifest["sparsity"]["selector"]["nbytes"]
        + (fd.ffn_bytes // 10)
    )


def test_calibrated_sketch_is_used_by_auto_with_its_dram_in_the_plan(tiny):
    _, _, data = tiny
    path = _flash(tiny, "sketch")
    _calibrate(path, data, "--max-ppl-increase", "10")
    fd = FlashDir(path)
    sel = fd.manifest["sparsity"]["selector"]
    assert sel["name"] == "sketch" and sel["bits"] == 2 and np.isfinite(sel["ppl_increase"])
    sp = make_sparsifier(fd, "auto", max_ppl_increase=10)
    assert isinstance(sp, Sketch) and sp.nbytes == sel["nbytes"] > 0
    # the saved sketch, loaded as the runtime loads it, gives the perplexity calibration recorded
    model, ctl = eval_model(fd)
    ctl.set_mode("sketch", sketch=sp)
    held = token_batches(load_tokenizer(fd), read_text([data], "second"), 32, 1)
    assert sel["held_out_tokens"] == 32 and perplexity(model, ctl, held) == pytest.approx(sel["ppl"], rel=1e-6)
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
    floor = min_streaming_budget(
        fd,
        64,
        kv_size_of(fd),
        resident=fd.resident_nbytes(cpu_cast),
        groups=stream_groups(fd, instantiate(fd.config), cpu_cast, 64),
    )
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
        list(
            __import__("mlx_lm.generate", fromlist=["generate_step"]).generate_step(
                mx.array([1, 2, 3]), model, max_tokens=3
            )
        )
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
    run = [
        sys.executable,
        "-m",
        "mlx_flash.generate",
        "--model",
        str(path),
        "--prompt",
        "hello",
        "--max-tokens",
        "3",
        "--stats",
        "--max-ppl-increase",
    ]
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
    from mlx_flash.calib.selector import selector_candidates

    assert [c["bits"] for c in selector_candidates("neurons")] == [2, 3, 4]  # cheapest DRAM first
    assert [c["bits"] for c in selector_candidates("neurons", sketch_bits=[4, 3])] == [3, 4]  # --sketch-bits
    assert [c["name"] for c in selector_candidates("dip")] == ["dip", "wina"]
    with pytest.raises(ValueError, match="does not serve the dip layout"):
        selector_candidates("dip", "sketch")


def test_runtime_and_evaluation_pick_the_same_units_on_smollm2(wikitext):
    """calib.quality evaluates the runtime's selector objects: in a forward pass over real text, the units the
    Controller masks in for each token are exactly what the runtime's select* (one token at a time) picks for
    the same FFN input, for every selector and region."""
    fd = FlashDir(default_model_dir())
    model, ctl = eval_model(fd)
    L, d, n = len(fd.layers), fd.ffn["hidden_size"], fd.ffn["intermediate_size"]
    weights = [dense_ffn_weights(fd, i) for i in range(L)]
    n_in, n_out = wina_norms(weights)
    rng = np.random.default_rng(0)
    preds = [
        {
            "A": mx.array(rng.normal(size=(8, d)).astype(np.float32)),
            "B": mx.array(rng.normal(size=(n, 8)).astype(np.float32)),
        }
        for _ in range(L)
    ]
    cases = {
        "sketch": {"sketch": Sketch(build_sketch(weights, None, 3, 64), "silu", 3, 64, [0.5] * L)},
        "predictor": {"predictors": preds, "predictor_density": 0.3},
        "dip": {"input_density": [0.6] * L, "neuron_density": [0.4] * L},
        "wina": {"input_density": [0.6] * L, "neuron_density": [0.4] * L, "input_norm": n_in, "neuron_norm": n_out},
        "oracle": {"density": 0.5},
    }
    ids = mx.array(load_tokenizer(fd).encode(wikitext[:3000])[:24])[None]
    for mode, kw in cases.items():
        ctl.set_mode(mode, **kw)
        sel, seen, masks = ctl._selector, [], ctl.masks
        ctl.masks = lambda layer, region, a: seen.append((layer, region, a, masks(layer, region, a))) or seen[-1][3]
        try:
            mx.eval(model(ids))
        finally:
            del ctl.masks
        assert sorted({(layer, region) for layer, region, _, _ in seen}) == sorted(
            (i, r) for i in range(L) for r in (("inputs", "neurons") if mode in ("dip", "wina") else ("neurons",))
        )
        for layer, region, a, m in seen:
            assert m.shape == a.shape[:1] + (m.shape[-1],) and 0 < m.mean() < 1, (mode, region)
            for row, mask in zip(a, m):
                if region == "inputs":
                    picked = sel.select_inputs(layer, row)
                elif mode in ("dip", "wina", "oracle"):  # ranked by the GLU the evaluation computed
                    picked = sel.select_neurons(layer, row)
                else:
                    picked = sel.select(layer, row)
                assert np.array_equal(np.flatnonzero(mask), picked), (mode, layer, region)
