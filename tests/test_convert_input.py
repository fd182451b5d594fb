"""Bad input to `python -m mlx_flash.convert` never crashes: a damaged GGUF, a signal mid-way and a mistyped path
each end in one line naming what is wrong (no traceback, no core dump), and leave no temporary directory behind."""

import os
import subprocess
import sys

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
