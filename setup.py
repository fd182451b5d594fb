import sys

from setuptools import Extension, find_packages, setup

# The native pread pool: plain CPython C API + buffer protocol, no numpy headers,
# so it builds with nothing but a C compiler and the Python headers.
pread_pool = Extension(
    "mlx_flash._pread_pool",
    sources=["kernels/pread_pool.c"],
    extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra"] + ([] if sys.platform == "darwin" else ["-pthread"]),
    extra_link_args=[] if sys.platform == "darwin" else ["-pthread", "-ldl"],  # dlopen: the system's zlib CRC
)

# Quantised matrix-vector products for MLX's CPU backend (Linux CI, Macs without Metal use):
# OpenMP threads where the compiler has it (Apple's clang does not; those builds run one thread).
openmp = [] if sys.platform == "darwin" else ["-fopenmp"]
cpu_gemv = Extension(
    "mlx_flash._cpu_gemv",
    sources=["kernels/cpu_gemv.c"],
    extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unknown-pragmas"] + openmp,
    extra_link_args=openmp,
)

mlx = "mlx" if sys.platform == "darwin" else "mlx[cpu]"

# The import package is `mlx_flash`; the distribution name is `mlx-flash-runtime` because `mlx-flash`
# (and `mlx_flash`, which normalises to it) is an unrelated project on PyPI.
setup(
    name="mlx-flash-runtime",
    version="0.1.0",
    description="Run LLMs larger than memory on Apple silicon: resident attention, FFN neurons streamed from flash",
    packages=find_packages(include=["mlx_flash", "mlx_flash.*"]) + ["mlx_flash.kernels"],
    package_dir={"mlx_flash.kernels": "kernels"},  # Metal sources ship inside the package
    # Metal sources, and the calibration / evaluation text (WikiText-2 test, CC BY-SA 3.0, with its README)
    package_data={"mlx_flash.kernels": ["*.metal"], "mlx_flash": ["data/wikitext-2/*"]},
    ext_modules=[pread_pool, cpu_gemv],
    # the user's commands, as mlx-lm names its own (`python -m mlx_flash.<command>` runs the same)
    entry_points={
        "console_scripts": [
            f"mlx_flash.{name} = mlx_flash.{module}:main"
            for name, module in [
                ("generate", "generate"),
                ("convert", "convert.build"),
                ("server", "server"),
                ("verify", "verify"),
                ("bench", "bench"),
                ("calibrate", "calibrate"),
                ("peers", "peers"),
            ]
        ]
    },
    python_requires=">=3.10",
    install_requires=[
        mlx,
        "mlx-lm>=0.30,<0.33",  # server.py, generation.py and models/ use private parts: tests/test_mlx_lm_contract.py
        "numpy",
        "huggingface_hub",
        "tokenizers",
        "transformers",
        "gguf",
        "tqdm",
    ],
    extras_require={
        "plot": ["matplotlib"],  # the commands' --plot flags (mlx_flash/tools/plot.py)
        "peers": ["nunspark==0.13.0"],  # a peer `python -m mlx_flash.peers` runs (llama.cpp it builds itself)
        "test": [
            "pytest",
            "pytest-xdist",
            "grimp",
            "hypothesis",
            "openai",
            "nbclient",
            "nbformat",
            "ipykernel",
            "matplotlib",
            "ruff",
        ],
    },
)
