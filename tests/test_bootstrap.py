"""bootstrap.sh's system-package step, run with stub apt-get / sudo / dpkg-query first on PATH."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _stub(d: Path, name: str, body: str):
    (d / name).write_text("#!/bin/bash\n" + body + "\n")
    (d / name).chmod(0o755)


def _run(tmp_path, uid: int, installed: bool):
    """Run the package step with only stubs and a few real tools on PATH; return the calls logged."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    for tool in ("uname", "dirname", "env", "grep"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    _stub(bin_dir, "id", f"echo {uid}")
    _stub(bin_dir, "apt-get", f'echo "apt-get DEBIAN_FRONTEND=${{DEBIAN_FRONTEND:-}} $*" >> {log}')
    _stub(bin_dir, "sudo", f'echo "sudo $1" >> {log}; exec "$@"')
    _stub(bin_dir, "dpkg-query", 'echo "install ok installed"' if installed else "exit 1")
    if installed:
        _stub(bin_dir, "fio", "exit 0")
    r = subprocess.run(
        [shutil.which("bash"), str(ROOT / "bootstrap.sh")],
        capture_output=True,
        text=True,
        env={"PATH": str(bin_dir), "BOOTSTRAP_SYSTEM_ONLY": "1"},
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    return log.read_text().splitlines() if log.exists() else []


def test_root_installs_missing_packages(tmp_path):
    assert _run(tmp_path, uid=0, installed=False) == [
        "apt-get DEBIAN_FRONTEND= update -qq",
        "apt-get DEBIAN_FRONTEND=noninteractive install -y -qq libopenblas0-pthread fio",
    ]


def test_user_installs_through_sudo(tmp_path):
    assert _run(tmp_path, uid=1000, installed=False) == [
        "sudo apt-get",
        "apt-get DEBIAN_FRONTEND= update -qq",
        "sudo env",
        "apt-get DEBIAN_FRONTEND=noninteractive install -y -qq libopenblas0-pthread fio",
    ]


def test_nothing_to_install(tmp_path):
    assert _run(tmp_path, uid=0, installed=True) == []


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed (.ci/run installs it)")
def test_shell_scripts_are_shellcheck_clean():
    r = subprocess.run(
        ["shellcheck", str(ROOT / "bootstrap.sh"), str(ROOT / ".ci" / "run")], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout
