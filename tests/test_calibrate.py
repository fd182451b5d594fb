"""Calibration: predictors learn and round-trip, DIP densities hit their target, reordering keeps
outputs identical and lengthens reads, the CLI runs end to end (tiny random models)."""

import json
import sys

from mlx_flash.calib.dip import allocate_densities, calibrate_dip, calibrate_dip_per_layer
from mlx_flash.calib.predictors import train_predictor, train_predictors
from mlx_flash.calib.quality import activation_targets, collect_inputs, dense_ffn_weights, eval_model, sequence_nll
from mlx_flash.calib.reorder import neuron_order, read_stats, reorder, reorder_group
from mlx_flash.calibrate import density_sweep, main
from mlx_flash.convert import convert
from mlx_flash.format.directory import FlashDir
from mlx_flash.loader import load_resident, make_sparsifier
from mlx_flash.models.tiny import make_tiny_model_dir

import mlx.core as mx
import numpy as np
import pytest


def _flash(tiny, name, **kw):
    root, src, _ = tiny
    return convert(str(src), root / name, progress=False, **kw)


def _batches(n=4, L=64, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, L + 1)).astype(np.int32)


def test_predictor_training_reduces_loss(tiny):
    fd = FlashDir(_flash(tiny, "train"))
    model, ctl = eval_model(fd)
    xs = collect_inputs(model, ctl, _batches())
    y = activation_targets(xs[0], dense_ffn_weights(fd, 0), "glu", "silu", 0.5)
    assert abs(y.mean() - 0.5) < 0.01
    _, losses = train_predictor(xs[0], y, rank=16, steps=150, lr=1e-2)
    assert losses[-1] < 0.8 * losses[0]


def test_saved_predictors_select_the_same_neurons(tiny):
    fd = FlashDir(_flash(tiny, "save"))
    model, ctl = eval_model(fd)
    xs = collect_inputs(model, ctl, _batches())
    res = train_predictors(fd, xs, 0.5, rank=8, rank_worst=16, worst_layers=1, steps=60, lr=1e-2)
    assert sorted(res["ranks"]) == [8, 16]
    fd.save_predictors(res["weights"], res["threshold"], ranks=res["ranks"], recall=res["recall"])
    sp = make_sparsifier(FlashDir(fd.path), "predictor")
    t = np.log(res["threshold"] / (1 - res["threshold"]))
    for layer, w in enumerate(res["weights"]):
        for x in xs[layer][:5]:
            z = np.array(w["B"]) @ (np.array(w["A"]) @ x)
            assert sp.select(layer, x).tolist() == np.flatnonzero(z > t).tolist()
    # the "auto" threshold makes the predicted density the target on the training tokens
    assert abs(np.mean(res["predicted_density"]) - 0.5) < 0.1


@pytest.mark.parametrize("target", [0.5, 0.3])
def test_dip_density_hits_target(tiny, target):
    fd = FlashDir(_flash(tiny, f"dip{int(target * 100)}", layout="dip"))
    model, ctl = eval_model(fd)
    res = calibrate_dip(model, ctl, _batches(2), target, count=3)
    fd.update_manifest(sparsity={**(fd.manifest.get("sparsity") or {}), "dip": res})
    d = FlashDir(fd.path).manifest["sparsity"]["dip"]
    # realised density measured over calibration tokens with the recorded per-layer densities
    ctl.set_mode("dip", input_density=d["input_density"], neuron_density=d["neuron_density"])
    for row in _batches(2, seed=1):
        mx.eval(model(mx.array(row[None, :-1])))
    assert abs(float(ctl.realised()["mlp"].mean()) - target) < 0.02
    sp = make_sparsifier(FlashDir(fd.path), "dip")
    assert sp.input_density == d["input_density"] and sp.neuron_density == d["neuron_density"]


def test_allocate_densities_keeps_the_mean_and_favours_sensitive_layers():
    levels = [[0.3, 0.5, 0.7, 1.0]] * 3
    costs = [[0.4, 0.0, -0.3, -0.5], [0.01, 0.0, -0.005, -0.01], [0.02, 0.0, -0.01, -0.02]]
    d = allocate_densities(levels, costs, 0.5)
    assert abs(np.mean(d) - 0.5) < 1e-9 and d[0] > 0.5 > d[1]
    flat = [[0.0, 0.0, 0.0, 0.0]] * 3
    assert abs(np.mean(allocate_densities(levels, flat, 0.6)) - 0.6) < 1e-9


def test_dip_per_layer_keeps_target_and_beats_uniform(tmp_path):
    """Layer 0's MLP output scaled up 4x: pruning it costs more, so it gets more density."""
    src = make_tiny_model_dir("llama", tmp_path / "src", num_hidden_layers=4)
    w = mx.load(str(src / "model.safetensors"))
    key = "model.layers.0.mlp.down_proj.weight"
    w[key] = w[key] * 4
    mx.save_safetensors(str(src / "model.safetensors"), w, metadata={"format": "mlx"})
    fd = FlashDir(convert(str(src), tmp_path / "flash", progress=False, layout="dip"))
    model, ctl = eval_model(fd)
    # text sampled from the dense model itself: dense is then the best model of it in expectation, so pruning a
    # layer raises the NLL (on random tokens a random model can gain from pruning, and sensitivities mean nothing)
    mx.random.seed(0)
    seq = mx.array([[1]])
    for _ in range(2 * 65 - 1):
        seq = mx.concatenate([seq, mx.random.categorical(model(seq)[:, -1])[None]], axis=1)
    batches = np.array(seq).reshape(2, 65).astype(np.int32)
    res = calibrate_dip_per_layer(model, ctl, batches, 0.5, count=3)
    pl = res["per_layer"]
    assert pl["chosen"] == "per-layer", pl
    assert abs(np.mean(pl["mlp_density"]) - 0.5) < 1e-6
    assert max(pl["mlp_density"]) - min(pl["mlp_density"]) >= 0.1  # not uniform
    assert pl["mlp_density"][0] == max(pl["mlp_density"])  # the sensitive layer gets the most
    assert abs(res["realised_mlp_density"] - 0.5) < 0.02
    ctl.set_mode("dip", input_density=res["input_density"], neuron_density=res["neuron_density"])
    per_layer_nll = sequence_nll(model, ctl, batches)
    uni = calibrate_dip(model, ctl, batches, 0.5, count=3)
    assert per_layer_nll <= min(r["nll"] for r in uni["search"]) + 1e-9
    fd.update_manifest(sparsity={**(fd.manifest.get("sparsity") or {}), "dip": res})
    sp = make_sparsifier(FlashDir(fd.path), "dip")
    assert sp.input_density == res["input_density"] and sp.neuron_density == res["neuron_density"]


@pytest.mark.parametrize(
    "arch,layout,bits,density",
    [
        ("llama", "neurons", None, 0.1),
        ("opt", "neurons", None, None),
        ("llama", "dip", None, None),
        ("llama", "dip", 4, None),
    ],
)
def test_reorder_keeps_outputs_and_lengthens_reads(tmp_path, arch, layout, bits, density):
    path = convert(
        str(make_tiny_model_dir(arch, tmp_path / "src")),
        tmp_path / "flash",
        progress=False,
        layout=layout,
        bits=bits,
        group_size=32,
    )
    fd = FlashDir(path)
    sparsity = "dip" if layout == "dip" else "oracle"
    x = mx.array([[1, 5, 9, 33, 2, 7, 100, 64]])
    model, _ = load_resident(path)
    ref = np.array(model(x))
    before = read_stats(path, sparsity=sparsity, tokens=12, prompt="hello world", density=density)
    # activity from the model itself, so the order is one a calibration would produce
    em, ctl = eval_model(fd)
    xs = collect_inputs(em, ctl, _batches(2))
    masks = [
        activation_targets(xi, dense_ffn_weights(fd, i), fd.ffn["kind"], fd.ffn["activation"], 0.3)
        for i, xi in enumerate(xs)
    ]
    perm = [neuron_order(m, reorder_group(fd)) for m in masks]
    reorder(path, perm)
    fd2 = FlashDir(path)
    assert fd2.manifest["neuron_order"] == [p.tolist() for p in perm]
    fd2.verify()
    model, _ = load_resident(path)
    assert np.allclose(np.array(model(x)), ref, atol=1e-4, rtol=1e-4)
    after = read_stats(path, sparsity=sparsity, tokens=12, prompt="hello world", density=density)
    assert after["tokens"] == before["tokens"]
    if density is not None:  # oracle top-10%: active sets with a hot core, measured 2744 -> 2829 B per request
        assert after["bytes_per_request"] > 1.01 * before["bytes_per_request"]
        assert after["requests"] < before["requests"]


def test_neuron_order_chains_coactive_neurons():
    rng = np.random.default_rng(0)
    masks = np.zeros((200, 12), dtype=bool)
    masks[:, 7] = True  # always on: first
    on = rng.random(200) < 0.5
    masks[np.ix_(on, [1, 4, 10])] = True  # a cluster
    masks[np.ix_(~on, [0, 3])] = True  # another
    order = neuron_order(masks).tolist()
    assert order[0] == 7 and sorted(order) == list(range(12))
    pos = {n: i for i, n in enumerate(order)}
    assert max(pos[n] for n in (1, 4, 10)) - min(pos[n] for n in (1, 4, 10)) == 2
    assert abs(pos[0] - pos[3]) == 1


def test_calibrate_cli_on_tiny_model(tiny, tmp_path, monkeypatch):
    root, _, data = tiny
    path = _flash(tiny, "cli")
    out = tmp_path / "report"
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "calibrate",
            "--model",
            str(path),
            "--data",
            str(data),
            "--seq-len",
            "64",
            "--num-seqs",
            "4",
            "--dip-seqs",
            "1",
            "--eval-seqs",
            "2",
            "--rank",
            "8",
            "--rank-worst",
            "16",
            "--worst-layers",
            "1",
            "--steps",
            "30",
            "--densities",
            "100,50",
            "--dip-candidates",
            "2",
            "--dip-per-layer",
            "--reorder",
            "--report",
            str(out),
            "--quiet",
        ],
    )
    main()
    fd = FlashDir(path)
    s = fd.manifest["sparsity"]
    assert s["predictor"]["ranks"] and len(s["predictor"]["recall"]) == len(fd.layers)
    assert s["dip"]["target"] == 0.5 and len(s["dip"]["input_density"]) == len(fd.layers)
    assert s["dip"]["per_layer"]["chosen"] in ("per-layer", "uniform")
    assert fd.manifest["neuron_order"] is not None
    report = json.loads((out / "report.json").read_text())
    modes = {r["mode"] for r in report["quality"]["rows"]}
    assert modes == {"dense", "oracle", "predictor", "dip", "dip-ca"}
    assert all(np.isfinite(r["ppl"]) for r in report["quality"]["rows"])
    assert (out / "report.png").stat().st_size > 0


def test_density_sweep_reports_each_density_and_writes_nothing(tiny):
    _, _, data = tiny
    path = _flash(tiny, "sweep")
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    out = density_sweep(
        path, [data], densities=(1.0, 0.75, 0.5), seq_len=32, calib_seqs=1, eval_seqs=2, dip_candidates=2, gamma=0.7
    )
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    rows = out["quality"]["rows"]
    assert [(r["mode"], r["target_density"]) for r in rows] == [("dense", 1.0)] + [
        (m, d) for d in (0.75, 0.5) for m in ("oracle", "dip", "dip-ca")
    ]
    assert set(out["dip"]) == {0.75, 0.5} and out["quality"]["gamma"] == 0.7
    for r in rows:
        assert abs(r["mlp_density"] - r["target_density"]) < 0.02 and np.isfinite(r["ppl"]), r
    assert out["quality"]["tokens"] == 2 * 32
