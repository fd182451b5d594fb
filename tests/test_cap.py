"""mlx_flash.tools.cap: a command under a hard memory cap (needs a writable memory cgroup)."""

import json
import os
import subprocess
import sys

from mlx_flash.tools.cap import CapError, _Cgroup, run_capped

import pytest

MiB = 1 << 20


def _cgroup_writable() -> str:
    try:
        _Cgroup(256 * MiB).remove()
        return ""
    except CapError as e:
        return str(e)


pytestmark = pytest.mark.skipif(bool(_cgroup_writable()), reason=f"no writable memory cgroup: {_cgroup_writable()}")


def test_over_the_limit_is_oom_killed():
    r = run_capped([sys.executable, "-c", "b = bytearray(400 << 20); print('survived')"], "150MiB")
    assert r.oom_killed and not r.ok
    assert "survived" not in r.stdout
    assert r.cgroup_peak <= 150 * MiB


def test_under_the_limit_completes_with_a_plausible_peak():
    # from a fresh process: Linux's exec keeps the larger of the launcher's peak RSS and the command's (the fork
    # before it maps the launcher's pages), and this test process may hold models loaded by earlier tests
    out = subprocess.run(
        [sys.executable, "-m", "mlx_flash.tools.cap", "--limit", "300MiB", "--json", "--"]
        + [sys.executable, "-c", "b = bytearray(80 << 20); print('done')"],
        capture_output=True,
        text=True,
        check=True,
    )
    r = json.loads(out.stdout)
    assert r["returncode"] == 0 and not r["oom_killed"] and r["stdout"].strip() == "done"
    assert 80 * MiB < r["max_rss"] < 300 * MiB
    assert 80 * MiB < r["cgroup_peak"] < 300 * MiB


@pytest.mark.parametrize("direct", [False, True])
def test_device_bytes_of_a_dropped_file(tmp_path, direct):
    f = tmp_path / "data.bin"
    size = 32 * MiB
    f.write_bytes(os.urandom(size))
    read = (
        "import mmap, os\n"
        f"fd = os.open({str(f)!r}, os.O_RDONLY | {os.O_DIRECT if direct else 0})\n"
        "buf = mmap.mmap(-1, 1 << 20)\n"
        "while os.readv(fd, [buf]): pass\n"
    )
    r = run_capped([sys.executable, "-c", read], "200MiB", drop=[f])
    assert r.ok, r.stderr
    assert abs(r.read_bytes - size) < 0.05 * size + 4 * MiB  # the interpreter's own files may add a little


def test_cgroup_is_removed():
    c = _Cgroup(64 * MiB)
    c.remove()
    run_capped(["true"], "64MiB")
    assert not [n for n in os.listdir(c.path.parent) if n.startswith(f"mlx_flash_cap_{os.getpid()}_")]


def test_no_cap_runs_with_rusage():
    r = run_capped(["true"], None)
    assert r.ok and r.backend == "none" and r.cgroup_peak is None


def test_sigterm_kills_the_child_and_removes_the_cgroup(tmp_path):
    import signal
    import subprocess
    import time

    p = subprocess.Popen([sys.executable, "-m", "mlx_flash.tools.cap", "--limit", "200MiB", "--", "sleep", "60"])
    c = _Cgroup(64 * MiB)
    c.remove()
    mine = lambda: [n for n in os.listdir(c.path.parent) if n.startswith(f"mlx_flash_cap_{p.pid}_")]  # noqa: E731
    deadline = time.monotonic() + 60
    while not mine() and time.monotonic() < deadline:  # (its handler is set before the cgroup is made)
        time.sleep(0.1)
    assert mine(), "the cgroup was never made"
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=20) == 128 + signal.SIGTERM
    assert not mine()
