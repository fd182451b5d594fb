"""Sparsifiers choose what they claim: predictors round-trip through the flash dir, oracle densities, top-K."""

from mlx_flash import FlashFormatError
from mlx_flash.convert import convert
from mlx_flash.engine.sparsity import Dense, Oracle, Predictor, dram_bytes, pass_units, prompt_units, top_k
from mlx_flash.format.directory import FlashDir
from mlx_flash.loader import load, make_sparsifier
from mlx_flash.models.tiny import make_tiny_model_dir

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step


@pytest.fixture(scope="module")
def flash(tmp_path_factory):
    root = tmp_path_factory.mktemp("sp")
    return convert(str(make_tiny_model_dir("llama", root / "src")), root / "flash", progress=False)


def test_top_k():
    s = np.array([0.1, 5.0, -1.0, 3.0, 2.0])
    assert top_k(s, 2).tolist() == [1, 3]
    assert top_k(s, 0).tolist() == [] and top_k(s, 9).tolist() == [0, 1, 2, 3, 4]
    assert top_k(s, 5).dtype == np.int32


class Fixed:
    """A selector picking given unit ids, one set per row asked."""

    name = "fixed"

    def __init__(self, sets):
        self.sets = iter(sets)

    def select(self, layer, x, cached=None):
        return np.array(next(self.sets), dtype=np.int32)


def test_prompt_units_are_the_union_until_it_passes_half_the_layer():
    rows = lambda: np.zeros((3, 4), np.float32)  # noqa: E731
    assert prompt_units(Fixed([[1], [3], [1]]), 0, rows, 10).tolist() == [1, 3]
    assert prompt_units(Fixed([[0, 1, 2], [3, 4, 5], [6]]), 0, rows, 10).tolist() == list(range(10))
    assert prompt_units(Dense(10), 0, lambda: pytest.fail("dense needs no rows"), 10).tolist() == list(range(10))


def test_pass_units_read_the_union_once_and_keep_each_position_to_its_own():
    same = np.array([2, 5], np.int32)
    units, mask = pass_units([same, same.copy()])
    assert units.tolist() == [2, 5] and mask is None
    units, mask = pass_units([same, np.array([1, 5], np.int32)])
    assert units.tolist() == [1, 2, 5] and mask.tolist() == [[0, 1, 1], [1, 0, 1]]


def test_dram_bytes_counts_the_oracles_copy(flash):
    oracle = make_sparsifier(FlashDir(flash), "oracle", 0.5)
    assert dram_bytes(oracle) == oracle.nbytes > 0 and dram_bytes(Dense(4)) == 0


def random_predictors(fd, rank=8, seed=0):
    rng = np.random.default_rng(seed)
    d, n = fd.ffn["hidden_size"], fd.ffn["intermediate_size"]
    return [
        {
            "A": mx.array(rng.normal(size=(rank, d)).astype(np.float32)),
            "B": mx.array(rng.normal(size=(n, rank)).astype(np.float32)),
        }
        for _ in fd.layers
    ]


def test_predictors_round_trip_and_select(flash, tmp_path):
    fd = FlashDir(flash)
    weights = random_predictors(fd)
    fd.save_predictors(weights, threshold=0.7, ranks=[8] * len(fd.layers))
    fd = FlashDir(flash)  # reopen: the manifest records them
    loaded = fd.load_predictors()
    for a, b in zip(weights, loaded):
        assert np.array_equal(np.array(a["A"]), np.array(b["A"])) and np.array_equal(np.array(a["B"]), np.array(b["B"]))
    assert make_sparsifier(fd, "auto").name == "dense"  # auto needs a measured perplexity increase
    sp = make_sparsifier(fd, "predictor")
    assert isinstance(sp, Predictor) and sp.threshold == 0.7
    x = np.random.default_rng(1).normal(size=fd.ffn["hidden_size"]).astype(np.float32)
    for layer, w in enumerate(weights):
        ref = 1 / (1 + np.exp(-(np.array(w["B"]) @ (np.array(w["A"]) @ x))))
        assert sp.select(layer, x).tolist() == np.flatnonzero(ref > 0.7).tolist()
    # the runtime runs with it and reads only predicted neurons
    model, _ = load(flash, sparsity="predictor", context=64)
    try:
        list(generate_step(mx.array([1, 2, 3]), model, max_tokens=3))
        model.flash.stats.end()
        assert all(0 < a < fd.ffn["intermediate_size"] for t in model.flash.stats.decode_tokens() for a in t.active)
    finally:
        model.flash.close()


def test_missing_predictor_file(flash):
    fd = FlashDir(flash)
    fd.save_predictors(random_predictors(fd), threshold=0.5)
    (flash / "predictors.safetensors").unlink()
    with pytest.raises(FlashFormatError, match="predictors.safetensors: missing file"):
        FlashDir(flash).load_predictors()


def test_oracle_density_is_top_k_of_true_glu(flash):
    fd = FlashDir(flash)
    dense, half = Oracle(fd), Oracle(fd, density=0.5)
    x = np.random.default_rng(2).normal(size=fd.ffn["hidden_size"]).astype(np.float32)
    h = np.abs(dense.activations(0, x))
    assert len(dense.select(0, x)) == np.count_nonzero(h)  # SwiGLU: (nearly) every neuron
    chosen = half.select(0, x)
    assert len(chosen) == round(0.5 * len(h))
    assert h[chosen].min() >= np.delete(h, chosen).max()
