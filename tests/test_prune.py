"""Wanda pruning: the exact target fraction per row (or column), the kept weights are the
highest-scoring ones (brute-force reference), uniform norms give magnitude pruning, dtypes
and array types are kept, and calibration norms agree between an mlx-lm model and its
resident flash directory (tiny random models)."""

import mlx_flash  # noqa: F401  (before mlx.core)
from mlx_flash.convert import convert, prune
from mlx_flash.convert.source import load_source_model
from mlx_flash.format import bitmap
from mlx_flash.loader import load_resident
from mlx_flash.models.tiny import make_tiny_model_dir

import mlx.core as mx
import numpy as np
import pytest


def _brute_force(w, norms, sparsity):
    """Per output row: sort (score, index) pairs and zero the first floor(sparsity * in)."""
    out = w.copy()
    n_prune = int(sparsity * w.shape[1])
    for i in range(w.shape[0]):
        pairs = sorted((abs(float(w[i, j])) * float(norms[j]), j) for j in range(w.shape[1]))
        for _, j in pairs[:n_prune]:
            out[i, j] = 0
    return out


@pytest.mark.parametrize("sparsity", [0.0, 0.3, 0.5, 0.7])
@pytest.mark.parametrize("shape", [(5, 8), (7, 33), (16, 100)])
def test_wanda_keeps_the_highest_scores_exactly(sparsity, shape):
    rng = np.random.default_rng(shape[1])
    w = rng.standard_normal(shape).astype(np.float32)
    norms = rng.random(shape[1]).astype(np.float32) * 3 + 0.1
    got = prune.prune_wanda(w, norms, sparsity)
    np.testing.assert_array_equal(got, _brute_force(w, norms, sparsity))
    n_zero = (got == 0).sum(axis=1)
    assert (n_zero == int(sparsity * shape[1])).all()
    np.testing.assert_array_equal(prune.row_sparsity(got), int(sparsity * shape[1]) / shape[1])


def test_wanda_differs_from_magnitude_when_norms_differ():
    w = np.array([[1.0, 2.0, 3.0, 4.0]], np.float32)
    norms = np.array([10.0, 1.0, 1.0, 0.1], np.float32)  # scores 10, 2, 3, 0.4
    np.testing.assert_array_equal(prune.prune_wanda(w, norms, 0.5), [[1.0, 0.0, 3.0, 0.0]])
    np.testing.assert_array_equal(prune.prune_magnitude(w, 0.5), [[0.0, 0.0, 3.0, 4.0]])


def test_uniform_norms_equal_magnitude_pruning():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((12, 50)).astype(np.float32)
    ones = np.full(50, 2.5, np.float32)  # any constant
    mag = np.where(np.argsort(np.argsort(np.abs(w), axis=1, kind="stable"), axis=1) < 25, 0, w)
    np.testing.assert_array_equal(prune.prune_wanda(w, ones, 0.5), mag)
    np.testing.assert_array_equal(prune.prune_magnitude(w, 0.5), mag)


def test_per_input_prunes_each_column_to_the_target():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((40, 9)).astype(np.float32)  # down_proj [d, n_ffn]: a column is a neuron
    got = prune.prune_wanda(w, rng.random(9) + 0.5, 0.5, per="input")
    assert ((got == 0).sum(axis=0) == 20).all()
    np.testing.assert_array_equal(got.T, prune.prune_magnitude(w.T, 0.5))


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_mx_arrays_keep_their_dtype_and_prune_to_positive_zero(dtype):
    rng = np.random.default_rng(4)
    w32 = rng.standard_normal((6, 64)).astype(np.float32)
    w = mx.array(w32).astype(dtype)
    got = prune.prune_wanda(w, mx.ones(64), 0.5)
    assert isinstance(got, mx.array) and got.dtype == dtype
    ref = prune.prune_magnitude(np.array(w.astype(mx.float32)), 0.5)
    np.testing.assert_array_equal(np.array(got.astype(mx.float32)), ref)
    # pruned entries are +0.0 (all bits zero), so the bitmap sees exactly the kept weights
    enc, cap = bitmap.encode_rows(got)
    assert cap == 32 and (bitmap.counts(enc, 64) == 32).all()


def test_bad_arguments_raise():
    w = np.ones((2, 4), np.float32)
    with pytest.raises(ValueError):
        prune.prune_wanda(w, np.ones(3), 0.5)
    with pytest.raises(ValueError):
        prune.prune_wanda(w, np.ones(4), 1.0)
    with pytest.raises(ValueError):
        prune.prune_wanda(w, np.ones(4), 0.5, per="rows")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("prune")
    src = make_tiny_model_dir("llama", root / "src")
    flash = convert(str(src), root / "flash", progress=False)
    return src, flash


def test_norms_agree_between_source_and_resident_models(tiny):
    src, flash = tiny
    batches = np.random.default_rng(0).integers(0, 256, (2, 24)).astype(np.int32)
    model, _ = load_source_model(src)
    before = np.array(model(mx.array(batches[:1])))
    a = prune.collect_input_norms(model, batches)
    after = np.array(model(mx.array(batches[:1])))
    np.testing.assert_array_equal(before, after)  # the recorders are removed again
    b = prune.collect_input_norms(load_resident(flash)[0], batches)
    assert len(a) == len(b) == 2
    for la, lb in zip(a, b):
        assert la["x"].shape == (64,) and la["h"].shape == (160,)
        assert (la["x"] > 0).all() and (la["h"] > 0).all()
        np.testing.assert_allclose(la["x"], lb["x"], rtol=1e-4)
        np.testing.assert_allclose(la["h"], lb["h"], rtol=1e-4)


def test_norms_are_l2_over_tokens(tiny):
    """One sequence of T tokens vs the same tokens split in two sequences would differ (context),
    but the same batch run twice doubles the sum of squares: norms grow by sqrt(2)."""
    src, _ = tiny
    model, _ = load_source_model(src)
    batch = np.random.default_rng(1).integers(0, 256, (1, 16)).astype(np.int32)
    one = prune.collect_input_norms(model, batch)
    two = prune.collect_input_norms(model, np.concatenate([batch, batch]))
    np.testing.assert_allclose(two[0]["x"], one[0]["x"] * np.sqrt(2), rtol=1e-5)
    np.testing.assert_allclose(two[1]["h"], one[1]["h"] * np.sqrt(2), rtol=1e-5)


def test_wikitext_norms_on_a_flash_dir(tiny, wikitext):
    _, flash = tiny
    norms, _ = prune.wikitext_input_norms(flash, n_seqs=2, seq_len=32)
    assert len(norms) == 2 and norms[0]["x"].shape == (64,) and norms[1]["h"].shape == (160,)


def test_norms_of_a_relu_model_with_biases(tmp_path):
    """OPT: h is recorded at fc2's input (after fc1's bias and the ReLU) in both model kinds."""
    src = make_tiny_model_dir("opt", tmp_path / "src")
    flash = convert(str(src), tmp_path / "flash", progress=False)
    batches = np.random.default_rng(5).integers(0, 256, (2, 16)).astype(np.int32)
    a = prune.collect_input_norms(load_source_model(src)[0], batches)
    b = prune.collect_input_norms(load_resident(flash)[0], batches)
    for la, lb in zip(a, b):
        np.testing.assert_allclose(la["x"], lb["x"], rtol=1e-4)
        np.testing.assert_allclose(la["h"], lb["h"], rtol=1e-4)
