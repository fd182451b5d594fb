"""Bad input to `python -m mlx_flash.convert` never crashes: a damaged GGUF, a signal mid-way and a mistyped path
each end in one line naming what is wrong (no traceback, no core dump), and leave no temporary directory behind."""

import os
import signal
import subprocess
import sys
import time

from mlx_flash.convert.source import resolve_source
from mlx_flash.errors import SourceError

import pytest


def convert_cli(*args, cwd=None):
    env = dict(os.environ, HF_HUB_OFFLINE="1")  # nothing is ever fetched
    return subprocess.run(
        [sys.executable, "-m", "mlx_flash.convert", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env=env,
    )


def assert_refused(r, *words):
    """Ended by mlx_flash (a nonzero exit status, not a signal) with one line on stderr naming what is wrong."""
    assert r.returncode > 0, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    for w in words:
        assert w in r.stderr, r.stderr


def leftovers(folder, out="out"):
    return sorted(p.name for p in folder.iterdir() if p.name == out or p.name.startswith(f".{out}."))


# -- signals ------------------------------------------------------------------------------------------------------
PAUSED_CONVERT = """
import sys, time
from mlx_flash.format.directory import FlashWriter
src, out, ready = sys.argv[1:]
real = FlashWriter.add_layer
def add(self, arrays):  # the first layer written, then wait to be signalled
    real(self, arrays)
    open(ready, "w").close()
    time.sleep(60)
FlashWriter.add_layer = add
from mlx_flash.convert.build import main
sys.argv = ["convert", "--model", src, "--out", out, "--dtype", "float16"]
main()
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_mid_way_removes_the_temporary_directory(tiny, tmp_path, sig):
    _, src, _ = tiny
    ready = tmp_path / "ready"
    p = subprocess.Popen(
        [sys.executable, "-c", PAUSED_CONVERT, str(src), str(tmp_path / "out"), str(ready)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        time.sleep(0.05)
    assert [n for n in leftovers(tmp_path) if n.startswith(".out.")], "no temporary directory mid-way"
    p.send_signal(sig)
    _, stderr = p.communicate(timeout=60)
    assert p.returncode != 0
    if sig == signal.SIGTERM:  # (Ctrl-C keeps Python's own ending)
        assert p.returncode == 128 + sig and "Traceback" not in stderr, (p.returncode, stderr)
    assert leftovers(tmp_path) == []


KILLED_CONVERT = """
import os, signal, sys
from mlx_flash.format.directory import FlashWriter
real = FlashWriter.add_layer
def add(self, arrays):
    real(self, arrays)
    os.kill(os.getpid(), signal.SIGKILL)
FlashWriter.add_layer = add
from mlx_flash.convert import convert
convert(sys.argv[1], sys.argv[2], progress=False)
"""


def test_a_rerun_removes_what_a_killed_run_left(tiny, tmp_path):
    """SIGKILL cannot be caught: its temporary directory stays until the next conversion to the same --out, which
    removes it (its process is gone), and leaves alone one of a conversion still running."""
    _, src, _ = tiny
    r = subprocess.run([sys.executable, "-c", KILLED_CONVERT, str(src), str(tmp_path / "out")])
    assert r.returncode == -signal.SIGKILL
    (stale,) = leftovers(tmp_path)
    running = tmp_path / f".out.{os.getpid()}.running"  # this process's: alive
    running.mkdir()
    r = convert_cli("--model", src, "--out", tmp_path / "out", "--dtype", "float16")
    assert r.returncode == 0, r.stderr
    assert leftovers(tmp_path) == sorted(["out", running.name])


# -- a mistyped path ------------------------------------------------------------------------------------------
def test_a_mistyped_local_path_is_not_a_hub_id(tmp_path):
    r = convert_cli("--model", "models/smol.gguf", "--out", tmp_path / "out", cwd=tmp_path)
    assert_refused(r, "no such file or directory: models/smol.gguf")
    assert "Hub" not in r.stderr
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize(
    "src, hub",
    [
        ("models/smol.gguf", False),
        ("smol.gguf", False),
        ("model.safetensors", False),
        ("./models/smol", False),
        ("../smol", False),
        ("~/models/smol", False),
        ("/models/smol", False),
        ("models/smol/v2", False),
        ("models\\smol", False),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", True),
        ("org/name", True),  # also what a missing relative `models/smol` looks like: `./models/smol` is a path
        ("Qwen/Qwen2.5-0.5B", True),
    ],
)
def test_what_goes_to_the_hub(tmp_path, monkeypatch, src, hub):
    """An `org/name` that is no file or directory here is a Hub id; anything else that looks like a path and does
    not exist is refused as a missing path, with no Hub fetch."""
    import huggingface_hub

    fetched = []

    def fetch(repo_id, **kwargs):
        fetched.append(repo_id)
        raise OSError("offline")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fetch)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SourceError) as e:
        resolve_source(src, tmp_path)
    assert fetched == ([src] if hub else [])
    if not hub:
        assert str(e.value) == f"no such file or directory: {src}"
