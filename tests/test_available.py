"""--memory-budget auto: what the machine can give (io/available.py's probes, on fake system files) and what load
plans with it (a fake probe): every unit cached where the model fits, the same tokens streamed where it does not."""

import ctypes
import subprocess
import sys

from mlx_flash import BudgetWarning, loader
from mlx_flash.budget import AUTO_HEADROOM, AUTO_RESERVE, auto_budget
from mlx_flash.io import available as av
from mlx_flash.io.available import Available, Limit

import mlx.core as mx
import pytest


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_meminfo(tmp_path):
    _write(tmp_path / "meminfo", "MemTotal:  100 kB\nMemFree:  10 kB\nMemAvailable:   2048 kB\n")
    assert av.meminfo(tmp_path / "meminfo") == Limit("MemAvailable", 2048 * 1024)
    assert av.meminfo(tmp_path / "absent") is None


def test_cgroup_v1_every_limited_ancestor_with_its_droppable_cache(tmp_path):
    """v1: each limited cgroup from the process's own up gives limit - usage + total_inactive_file; unlimited ones
    (2^63 rounded to a page) give nothing."""
    root = tmp_path / "sys"
    _write(tmp_path / "cgroup", "5:devices:/\n4:memory:/outer/inner\n0::/\n")
    inner, outer = root / "memory" / "outer" / "inner", root / "memory" / "outer"
    for d, limit, usage, inactive in ((inner, 1 << 30, 600 << 20, 100 << 20), (outer, 9223372036854771712, 5, 0)):
        _write(d / "memory.limit_in_bytes", f"{limit}\n")
        _write(d / "memory.usage_in_bytes", f"{usage}\n")
        _write(d / "memory.stat", f"inactive_file 7\ntotal_inactive_file {inactive}\n")
    _write(root / "memory" / "memory.limit_in_bytes", "2097152\n")  # the root: 2 MiB, all used
    _write(root / "memory" / "memory.usage_in_bytes", "2097152\n")
    got = av.cgroup_limits(tmp_path / "cgroup", root)
    assert [g.bytes for g in got] == [(1 << 30) - (600 << 20) + (100 << 20), 0]
    assert "v1 limit 1024 MiB" in got[0].what
    assert Available(got).bytes == 0


def test_cgroup_v2_and_a_namespace_view(tmp_path):
    """v2: memory.max - memory.current + inactive_file, "max" is no limit; a path the mount does not show (a cgroup
    namespace) reads the mount's root, the process's own cgroup."""
    root = tmp_path / "sys"
    _write(tmp_path / "cgroup", "0::/not/visible\n")
    _write(root / "cgroup.controllers", "memory\n")
    _write(root / "memory.max", f"{3 << 30}\n")
    _write(root / "memory.current", f"{1 << 30}\n")
    _write(root / "memory.stat", f"anon 5\ninactive_file {1 << 20}\n")
    assert [g.bytes for g in av.cgroup_limits(tmp_path / "cgroup", root)] == [(2 << 30) + (1 << 20)]
    _write(root / "memory.max", "max\n")
    assert av.cgroup_limits(tmp_path / "cgroup", root) == []


def test_macos_vm_statistics_layout():
    """struct vm_statistics64 is HOST_VM_INFO64_COUNT (38) integers long, and reclaimable counts free, inactive,
    purgeable and speculative pages (not active, wired or compressed ones)."""
    assert ctypes.sizeof(av.VMStatistics64) == 38 * 4
    s = av.VMStatistics64(free_count=1, active_count=100, inactive_count=2, wire_count=100)
    s.purgeable_count, s.speculative_count, s.compressor_page_count = 3, 4, 100
    assert av.reclaimable(s, 16384) == 10 * 16384


def test_ranks_of_a_launch_share_their_machine(tmp_path):
    """mlx.launch's ring hostfile: ranks at the same addresses share a machine (and its memory)."""
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text('[["127.0.0.1:5000"], ["127.0.0.1:5001"], ["10.0.0.2:5002"]]')
    env = {"MLX_HOSTFILE": str(hostfile), "MLX_RANK": "1"}
    assert av.ranks_here(env) == 2 and av.ranks_here({**env, "MLX_RANK": "2"}) == 1
    assert av.ranks_here({}) == 1 and av.ranks_here({"MLX_HOSTFILE": str(tmp_path / "absent")}) == 1
    shared = Available([Limit("probe", 3000)], ranks=2)
    assert shared.bytes == 1500 and "2 ranks" in shared.describe()


def test_available_here():
    """On this machine at least MemAvailable answers, and the least of the probes is what it says."""
    a = av.available()
    assert a.limits and a.bytes == min(lim.bytes for lim in a.limits) and a.bytes > 0
    assert "MemAvailable" in a.describe()


def _fake_machine(monkeypatch, nbytes):
    monkeypatch.setattr(loader, "available", lambda: Available([Limit("fake probe", nbytes)]))


def _greedy(model, prompt, n=12):
    from mlx_flash.generate import generate_step

    return [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


def test_auto_is_resident_where_the_model_fits_and_streams_the_same_tokens_where_not(smol, monkeypatch):
    _fake_machine(monkeypatch, 64 << 30)
    model, tok = loader.load(smol)  # (the default: auto)
    assert model.flash.plan.budget is None and "all resident" in model.flash.budget_note
    prompt = tok.encode("The history of the city begins")
    resident = _greedy(model, prompt)
    model.flash.close()

    small = int((AUTO_RESERVE + (60 << 20)) / (1 - AUTO_HEADROOM))  # a budget of 60 MiB: SmolLM2 needs ~100
    _fake_machine(monkeypatch, small)
    model, _ = loader.load(smol, memory_budget="auto", context=64)
    plan = model.flash.plan
    assert plan.budget == auto_budget(small) < 61 << 20
    assert sum(c for layer in plan.capacity for c in layer.values()) < sum(
        r.n_units for layer in model.flash.fd.layers for r in layer.values()
    )
    assert "fake probe" in model.flash.budget_note and "budget" in model.flash.budget_note
    assert _greedy(model, prompt) == resident
    model.flash.close()


def test_a_budget_above_what_the_machine_gives_warns(smol, monkeypatch):
    _fake_machine(monkeypatch, 50 << 20)
    with pytest.warns(BudgetWarning, match="more than this machine can give now"):
        model, _ = loader.load(smol, memory_budget="90%")
    model.flash.close()


def test_no_probe_caches_everything(smol, monkeypatch):
    monkeypatch.setattr(loader, "available", lambda: Available([]))
    model, _ = loader.load(smol)
    assert model.flash.plan.budget is None and "no probe" in model.flash.budget_note
    model.flash.close()


def test_generate_says_what_auto_chose(smol):
    r = subprocess.run(
        [sys.executable, "-m", "mlx_flash.generate", "--model", str(smol), "--prompt", "hi", "-m", "2", "--stats"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "memory: auto: this machine can give" in r.stdout and "MemAvailable" in r.stdout


def test_a_context_too_long_for_the_budget_says_the_longest_it_holds(smol):
    import re

    from mlx_flash.errors import BudgetError

    with pytest.raises(BudgetError, match="it holds a context of at most") as e:
        loader.load(smol, memory_budget="50%", context=4000)
    held = int(re.search(r"at most (\d+) tokens", str(e.value)).group(1))
    assert 100 < held < 4000
    model, _ = loader.load(smol, memory_budget="50%", context=held)
    model.flash.close()
    with pytest.raises(BudgetError):
        loader.load(smol, memory_budget="50%", context=held + 64)


@pytest.mark.parametrize("kv_bits, hint", [(None, ", or --kv-bits 8)"), (8, ", or --kv-bits 4)"), (4, "--max-tokens)")])
def test_a_context_too_long_suggests_only_a_narrower_kv_cache(smol, kv_bits, hint):
    from mlx_flash.errors import BudgetError

    with pytest.raises(BudgetError, match="it holds a context of at most") as e:
        loader.load(smol, memory_budget="50%", context=40000, kv_bits=kv_bits, plan_only=True)
    assert str(e.value).endswith(hint)


CHUNK = """
import json, sys
import mlx_flash
import mlx.core as mx
from mlx_flash.budget import kv_cache_bytes, pass_bytes, position_bytes
from mlx_flash.format.config import head_dim
from mlx_flash.io import memory
from mlx_flash.loader import kv_size_of, load

path, m, offset = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
kv_bits = int(sys.argv[4]) if sys.argv[4] != "0" else None
context = offset + m + 8
model, _ = load(path, memory_budget=None, context=context, kv_bits=kv_bits)
mx.eval(model.forward(list(range(1, 9)), model.make_cache(), True))  # (kernels built, buffers made)
cache, fd = model.make_cache(), model.flash.fd
if offset:  # (a context before the pass: its keys and values written as a prompt's passes would)
    kv = mx.random.normal((1, fd.config["num_key_value_heads"], offset, head_dim(fd.config)))
    mx.eval([c.update_and_fetch(kv, kv) for c in cache])
before = memory.rss()
memory.reset_peak()
mx.eval(model.forward(list(range(1, m + 1)), cache, True))
kv = kv_cache_bytes(fd.config, m, kv_size_of(fd, kv_bits=kv_bits), kv_bits) * m // ((context + 1 + 31) // 32 * 32)
native = model.forward.native
formula = position_bytes(fd, context, native) * m + pass_bytes(fd, context, native)
print(json.dumps({"transient": memory.peak_rss() - before - kv, "formula": formula}))
"""


@pytest.mark.parametrize(
    "backend, offset, kv_bits", [("auto", 0, 0), ("mlx", 0, 0), ("auto", 1536, 0), ("auto", 1536, 8)]
)
def test_a_prompt_chunk_takes_at_most_what_the_plan_counts_a_position(smol, backend, offset, kv_bits):
    """The peak of a 256-position prompt pass above the memory before it (less the keys and values it writes) is at
    most budget.position_bytes a position and pass_bytes a pass, on both forwards, and after a long context too
    (the native attention's scores are one query's at a time, not a position's; a quantised KV cache's, MLX's
    forward, over every key at once): the prompt's chunks (Plan.prefill_step) hold the workspace."""
    import json
    import os

    env = {**os.environ, "MLX_FLASH_BACKEND": backend}
    r = subprocess.run(
        [sys.executable, "-c", CHUNK, str(smol), "256", str(offset), str(kv_bits)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.splitlines()[-1])
    assert 0.1 * got["formula"] < got["transient"] <= got["formula"], got
