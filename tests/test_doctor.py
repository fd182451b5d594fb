"""mlx_flash.doctor: the plan it prints is load's, and the bytes a token reads it expects are what decoding reads."""

import io
import subprocess
import sys

from mlx_flash import doctor
from mlx_flash.generate import generate_step
from mlx_flash.loader import load

import mlx.core as mx


def test_expected_reads_are_what_a_dense_token_reads(smol):
    """SmolLM2 at 75% of its size: the bytes doctor expects a token to read equal the engine's count of what
    decode tokens read (a dense token reads every unit its caches do not hold)."""
    out = io.StringIO()
    plan, expected, rate = doctor.report(smol, "75%", context=64, seconds=0.1, out=out)
    model, tok = load(smol, memory_budget="75%", context=64, sparsity="dense")
    assert model.flash.plan.capacity == plan.capacity and model.flash.plan.streamed == plan.streamed
    steps = generate_step(mx.array(tok.encode("The history of the city")), model, max_tokens=6)
    for _ in steps:
        pass
    stats = model.flash.stats
    stats.end()
    decode = [t.bytes_requested for t in stats.tokens if not t.prefill][1:]  # (the first: the read-ahead's start)
    model.flash.close()
    assert expected > 0 and rate > 0
    assert all(abs(b - expected) <= 0.01 * expected for b in decode), (decode, expected)
    text = out.getvalue()
    assert "machine: can give" in text and "plan (64 tokens of context): budget" in text
    assert "tokens/s from reads alone" in text


def test_every_unit_cached_reads_nothing(smol):
    out = io.StringIO()
    plan, expected, _ = doctor.report(smol, None, context=64, seconds=0.05, out=out)
    assert plan.budget is None and expected == 0 and "every unit cached" in out.getvalue()


def test_the_command(smol):
    r = subprocess.run(
        [sys.executable, "-m", "mlx_flash.doctor", "--model", str(smol), "--seconds", "0.1", "--max-context", "64"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "memory: auto: this machine can give" in r.stdout and "disk:" in r.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "mlx_flash.doctor", "--model", str(smol), "--memory-budget", "1MiB"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 1 and bad.stderr.startswith("error: memory budget") and "Traceback" not in bad.stderr
