"""A dense GGUF's K-quant FFN kept as the file's blocks: units of 256 neurons (models/blocked.py), each its gate and
up rows and one block of every down row, computed by the expert engine; the bytes a token reads are the file's."""

from pathlib import Path

from mlx_flash.convert import convert
from mlx_flash.convert.gguf import BLOCKED_UNITS, kept_dense, read_header
from mlx_flash.engine.experts import REGION
from mlx_flash.format.directory import FlashDir
from mlx_flash.loader import load, load_resident
from mlx_flash.models.blocked import UNITS, BlockedMLP
from mlx_flash.tools.peers_systems import llama_cpp_path
from mlx_flash.tools.synthetic_gguf import write_gguf

import gguf as gguf_package
import mlx.core as mx
import numpy as np
import pytest
from test_in_place import PROMPT, decode, same_bits_at_every_budget

SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, vocab_size=512, num_attention_heads=2)
SHAPE.update(num_key_value_heads=1)


@pytest.fixture(scope="module", params=["Q4_K_M", "Q2_K", "IQ4_XS"])
def blocked(tmp_path_factory, request):
    """(a dense llama GGUF as llama-quantize mixes its types: Q4_K_M's Q4_K gate and up, Q4_K and Q6_K down rows;
    Q2_K's Q2_K with Q3_K down rows; IQ4_XS's; its flash directory)."""
    root = tmp_path_factory.mktemp("blocked")
    gguf = write_gguf("tiny", root / "d.gguf", progress=False, gguf_type=request.param, **SHAPE)
    return gguf, convert(str(gguf), root / "flash", progress=False)


def _tensors(gguf) -> dict:
    return {t.name: t for t in read_header(gguf).tensors}


def _matrix(t) -> np.ndarray:
    """A GGUF matrix dequantised by the gguf package, [rows, columns] in float64."""
    w = gguf_package.quants.dequantize(np.asarray(t.data), t.tensor_type)
    return w.reshape(int(t.shape[1]), int(t.shape[0])).astype(np.float64)


def test_a_unit_is_256_neurons_as_the_file_stores_them(blocked):
    """Each unit's gate and up rows are the file's rows of its 256 neurons, and its down rows the file's block of
    those neurons of each down row, byte for byte (each layer's own types); ffn.bin holds the FFN's bytes but
    alignment: what a token reads is the file's."""
    gguf, flash = blocked
    fd, tensors = FlashDir(flash), _tensors(gguf)
    assert fd.config[UNITS] == BLOCKED_UNITS and fd.ffn["experts_per_token"] == 768 // BLOCKED_UNITS
    ffn = [t for t in tensors.values() if ".ffn_" in t.name]
    assert 0 <= fd.ffn_path.stat().st_size - sum(t.n_bytes for t in ffn) < len(ffn) * fd.alignment
    kinds = set()
    for i in range(4):
        rows = fd.read_region(i, REGION)
        assert len(rows) == 3
        for c, p in zip(fd.layout_of(i, REGION).components, ("gate", "up", "down")):
            t = tensors[f"blk.{i}.ffn_{p}.weight"]
            kinds.add(t.tensor_type.name)
            raw = np.asarray(t.data).reshape(int(t.shape[1]), -1)  # the file's rows
            if p == "down":  # [256 rows, 3 blocks] -> block b of every row
                raw = raw.reshape(len(raw), 3, -1).swapaxes(0, 1)
            got = rows[:, c.offset : c.offset + c.nbytes].reshape(3, -1)
            assert np.array_equal(got, np.ascontiguousarray(raw).reshape(3, -1)), (i, p)
    assert len(kinds) > 1 or "IQ4_XS" in kinds  # (a mix's types)
    fd.verify()


def test_the_ffn_is_the_files_matrices_and_exports_whole(blocked, tmp_path):
    """Each layer's FFN (blocks summed) is the FFN of the file's dequantised matrices; exported for mlx-lm it is a
    dense FFN of the same values."""
    from mlx_flash.convert.export import export

    from mlx_lm.utils import load_model

    gguf, flash = blocked
    tensors = _tensors(gguf)
    resident, _ = load_resident(flash, dtype=mx.float32)
    exported, _ = load_model(Path(export(flash, tmp_path / "mlx", progress=False)))
    exported.set_dtype(mx.float32)
    x = np.random.default_rng(0).standard_normal((3, 256))
    for i in range(4):
        gate, up, down = (_matrix(tensors[f"blk.{i}.ffn_{p}.weight"]) for p in ("gate", "up", "down"))
        a = x @ gate.T
        want = (a / (1 + np.exp(-a)) * (x @ up.T)) @ down.T
        mlp = resident.model.layers[i].mlp
        assert isinstance(mlp, BlockedMLP)
        for m in (mlp, exported.model.layers[i].mlp):
            got = np.array(m(mx.array(x.astype(np.float32))))
            assert np.abs(got - want).max() < 1e-5 * np.abs(want).max(), i
    assert type(exported.model.layers[0].mlp).__name__ == "MLP"


@pytest.mark.parametrize("ops", ["native", "mlx"])
def test_the_same_bits_at_every_budget(blocked, ops, monkeypatch):
    """Greedy tokens and log-probabilities equal at every budget (every unit cached, two, one, none a layer) on either
    path; MLX's equal mlx-lm's model on the same weights (load_resident) bit for bit."""
    from mlx_flash.compute import cpu_gemv

    if ops == "native" and not cpu_gemv.available():
        pytest.skip("the native CPU kernels do not run here")
    monkeypatch.setattr(cpu_gemv, "enabled", ops == "native")
    same_bits_at_every_budget(blocked[1], (None, 2, 1, 0), ops)


def test_the_next_layers_blocks_are_read_ahead(blocked):
    """Below the whole model, two staging buffers take the next layer's uncached blocks while a layer computes (a
    dense step reads them every token: budget.every_unit_region), and every block read ahead is used."""
    from mlx_flash.engine.read_ahead import ReadAhead
    from mlx_flash.generate import generate_step

    from test_moe import slots_budget

    _, flash = blocked
    model, _ = load(flash, memory_budget=slots_budget(FlashDir(flash), 2), context=64)
    try:
        assert model.flash.plan.prefetch_rows > 0 and isinstance(model.flash.read_ahead, ReadAhead)
        list(generate_step(PROMPT, model, max_tokens=4))
        steps = model.flash.stats.decode_tokens()
        assert all(t.ahead_bytes > 0 and t.ahead_wasted_bytes == 0 for t in steps[1:]), steps
    finally:
        model.flash.close()


def test_neurons_stay_units_where_the_file_holds_no_k_quant_ffn(tmp_path):
    """A Q4_0 file's FFN is MLX's affine codes exactly: its neurons stay units (with their selectors); so too a file
    whose FFN is not whole blocks of 256 neurons."""
    q4_0 = write_gguf("tiny", tmp_path / "q4_0.gguf", progress=False, **SHAPE)
    odd = {**SHAPE, "intermediate_size": 640}
    odd = write_gguf("tiny", tmp_path / "odd.gguf", progress=False, gguf_type="Q4_K_M", **odd)
    for gguf in (q4_0, odd):
        assert kept_dense(read_header(gguf), gguf) == {}
    fd = FlashDir(convert(str(q4_0), tmp_path / "flash", progress=False))
    assert fd.ffn["kind"] != "moe" and UNITS not in fd.config


@pytest.mark.skipif(
    not llama_cpp_path("llama-quantize").is_file(),
    reason="llama-quantize not built (python -m mlx_flash.peers builds it)",
)
def test_a_llama_quantize_q4_k_m_file_of_narrow_rows_is_its_blocks(tmp_path, monkeypatch):
    """llama.cpp's own Q4_K_M of a model whose rows are not whole super-blocks (as SmolLM2's 576): gate and up fall
    back to Q5_0, down rows are Q4_K and Q6_K. The FFN is still the file's blocks (ffn.bin its FFN tensors' bytes but
    alignment), and streamed it gives the resident model's tokens and log-probabilities on either path."""
    import subprocess

    from mlx_flash.compute import cpu_gemv

    src = write_gguf("tiny", tmp_path / "src.gguf", progress=False, **{**SHAPE, "hidden_size": 96})
    exe = llama_cpp_path("llama-quantize")
    gguf = tmp_path / "q4_k_m.gguf"
    r = subprocess.run(
        [exe, "--allow-requantize", src, gguf, "Q4_K_M"], capture_output=True, text=True,
        env={"LD_LIBRARY_PATH": str(exe.parent)},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    tensors = _tensors(gguf)
    kinds = {p: {tensors[f"blk.{i}.ffn_{p}.weight"].tensor_type.name for i in range(4)} for p in ("gate", "down")}
    assert kinds == {"gate": {"Q5_0"}, "down": {"Q4_K", "Q6_K"}}
    fd = FlashDir(convert(str(gguf), tmp_path / "flash", progress=False))
    assert fd.config[UNITS] == BLOCKED_UNITS and fd.ffn["quantization"]["gate_proj"]["ggml"] == "Q5_0"
    ffn = [t for t in tensors.values() if ".ffn_" in t.name and t.name.endswith("proj.weight") is False]
    ffn = [t for t in ffn if "norm" not in t.name]
    assert 0 <= fd.ffn_path.stat().st_size - sum(t.n_bytes for t in ffn) < len(ffn) * fd.alignment
    for native in (True, False):
        monkeypatch.setattr(cpu_gemv, "enabled", native and cpu_gemv.available())
        runs = [decode(fd.path, slots) for slots in (None, 1, 0)]
        for tokens, logprobs in runs[1:]:
            assert tokens == runs[0][0] and np.array_equal(logprobs, runs[0][1])


@pytest.mark.native
def test_the_native_step_computes_the_blocks_with_no_mlx_op(blocked, monkeypatch):
    """On the native step a decode token's blocks are summed on the host rows (FlashSwitchGLU.blocks_sum): the
    MLX forward of the FFN is never called."""
    from mlx_flash.generate import generate_step

    model, _ = load(blocked[1], context=64)
    try:
        assert model.forward.native, model.forward.why
        tokens = generate_step(PROMPT, model, max_tokens=4)
        next(tokens)

        def refused(self, x):
            raise AssertionError("the MLX forward of a blocked FFN ran in a native decode step")

        monkeypatch.setattr(BlockedMLP, "__call__", refused)
        assert len(list(tokens)) == 3
    finally:
        model.flash.close()
