import mlx_flash  # noqa: F401  first, so OpenBLAS is loaded before mlx.core (see mlx_flash/blas.py)
from mlx_flash.compute import cpu_gemv
from mlx_flash.texts import read_text

import pytest


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "native: needs the native CPU kernels (kernels/cpu_gemv.c); skipped where they do not run (MLX on a GPU, "
        "MLX_FLASH_BACKEND=mlx, MLX_FLASH_CPU_KERNELS=0, not built)",
    )
    config.addinivalue_line(
        "markers",
        "backend_fixed: computes the same way whatever MLX_FLASH_BACKEND says (MLX's own ops forced, or a backend "
        "of its own; added at collection), so a pass with MLX_FLASH_BACKEND=mlx after a full one may leave it out "
        "(-m 'not backend_fixed')",
    )


def pytest_collection_modifyitems(config, items):
    for item in items:  # (CI's second pass, all through MLX's ops, leaves these out: the first ran them the same way)
        params = getattr(item, "callspec", None) and item.callspec.params or {}
        fixed = params.get("ops") in ("mlx", True) or "backend" in params
        if fixed or {"mlx_ops", "mlx_backend"} & set(item.fixturenames):
            item.add_marker("backend_fixed")
    if cpu_gemv.available():
        return
    skip = pytest.mark.skip(reason="the native CPU kernels do not run here")
    for item in items:
        if "native" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def wikitext() -> str:
    """The WikiText-2 test split the package ships."""
    return read_text()


CALIBRATION_TEXT = (
    "The quick brown fox jumps over the lazy dog. " * 40 + "Pack my box with five dozen liquor jugs. " * 40
)


@pytest.fixture
def float_activations():
    """Float32 activations in the native matvecs. Their int8 default rounds x per block (as llama.cpp does), so
    a test comparing with another path's arithmetic (MLX's ops, stock mlx-lm) would hold only to that rounding."""
    from mlx_flash.compute import cpu_gemv

    cpu_gemv.set_int8_activations(False)
    yield
    cpu_gemv.set_int8_activations(True)


_BASELINES = {}  # model directory -> peak RSS of the interpreter with its tokenizer loaded


@pytest.fixture
def generate_capped():
    """run(model_dir, budget, *args): `python -m mlx_flash.generate --model DIR --memory-budget BUDGET --stats ARGS`
    under a cgroup limit of the budget (bytes, or a string such as "25%" of the model) + the interpreter's baseline
    for that directory; skips where this machine has no hard cap. Returns (result, the peak RSS above the baseline
    that generate printed in bytes, or None)."""
    import re
    import sys

    from mlx_flash.budget import parse_size
    from mlx_flash.errors import CapError
    from mlx_flash.format.directory import FlashDir
    from mlx_flash.io import memory
    from mlx_flash.tools.cap import run_capped

    def run(model_dir, budget, *args):
        if model_dir not in _BASELINES:
            base = run_capped(memory.baseline_command(model_dir))
            assert base.ok, base.stderr
            _BASELINES[model_dir] = base.max_rss
        limit = parse_size(budget, FlashDir(model_dir).model_bytes) + _BASELINES[model_dir]
        try:
            r = run_capped(
                [
                    sys.executable,
                    "-m",
                    "mlx_flash.generate",
                    "--model",
                    str(model_dir),
                    "--memory-budget",
                    str(budget),
                    "--stats",
                    *args,
                ],
                limit=limit,
                drop=[model_dir],
                timeout=600,
            )
        except CapError as e:
            pytest.skip(f"no hard memory cap on this machine: {e}")
        m = re.search(r"memory: peak RSS ([\d.]+) (KiB|MiB|GiB) above the baseline", r.stdout)
        return r, m and float(m.group(1)) * {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[m.group(2)]

    return run


@pytest.fixture
def mlx_ops(monkeypatch):
    """MLX's own ops for quantised products (the native kernels, which take up to NATIVE_ROWS rows, off)."""
    from mlx_flash.compute import cpu_gemv

    monkeypatch.setattr(cpu_gemv, "enabled", False)


@pytest.fixture(scope="session")
def smol(tmp_path_factory):
    """SmolLM2-135M-Instruct's GGUF converted with convert's defaults (read only)."""
    from mlx_flash.convert import convert
    from mlx_flash.default_model import default_gguf_path

    return convert(str(default_gguf_path()), tmp_path_factory.mktemp("smol") / "flash", progress=False)


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory):
    """A tiny 4-bit qwen3_moe (the MoE architecture the native step computes), converted (read only)."""
    from mlx_flash.convert import convert
    from mlx_flash.tools.synthetic import tiny_quantized

    root = tmp_path_factory.mktemp("moe")
    return convert(str(tiny_quantized("qwen3_moe", root)), root / "flash", progress=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random llama model directory and a short text file to calibrate on: (root, src, text path)."""
    from mlx_flash.models.tiny import make_tiny_model_dir

    root = tmp_path_factory.mktemp("tiny")
    src = make_tiny_model_dir("llama", root / "src")
    data = root / "text.txt"
    data.write_text(CALIBRATION_TEXT)
    return root, src, data


@pytest.fixture(scope="module")
def start_server():
    """start(argv): `python -m mlx_flash.server ARGV` in this process on a free port: (provider, generator, port);
    each server it started stops with the module."""
    from mlx_flash.server import ModelProvider, serve, setup_arg_parser

    started = []

    def start(argv):
        provider = ModelProvider(setup_arg_parser().parse_args([str(a) for a in argv]))
        httpd, generator = serve(provider, port=0)
        started.append((httpd, generator, provider))
        return provider, generator, httpd.server_address[1]

    yield start
    for httpd, generator, provider in started:
        httpd.shutdown()
        httpd.server_close()
        generator.stop_and_join()
        provider.close()
