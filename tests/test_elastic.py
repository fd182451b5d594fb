"""The server's elastic budget (--memory-budget auto): when what the machine can give shrinks, the unit caches give
memory back between passes, below the floor requests get a 503 with the reason, when it grows they take more; a
conversation's answers stay those of a fixed budget. The machine is a fake probe."""

import http.client
import json
import time

from mlx_flash.budget import AUTO_HEADROOM, AUTO_RESERVE
from mlx_flash.io.available import Available, Limit

import mlx.core as mx
import pytest


@pytest.fixture
def served(smol, start_server):
    return start_server(
        ["--model", smol, "--max-context", "256", "--sparsity", "dense", "--max-batch", "2",
         "--prompt-cache-size", "2"]  # (the default --memory-budget: auto)
    )  # fmt: skip


def post(port, messages):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    body = {"messages": messages, "max_tokens": 12, "temperature": 0}
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    payload = json.loads(r.read())
    conn.close()
    return r.status, payload


def metrics(port):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", "/metrics")
    out = json.loads(conn.getresponse().read())
    conn.close()
    return out


def conversation(port, between=lambda turn: None):
    """Three chat turns, each with the answers before it; `between(turn)` runs before each turn."""
    messages, answers = [], []
    for turn, text in enumerate(["Name a colour.", "And a fruit?", "Now an animal."]):
        between(turn)
        messages.append({"role": "user", "content": text})
        status, r = post(port, messages)
        assert status == 200, r
        answers.append(r["choices"][0]["message"]["content"])
        messages.append({"role": "assistant", "content": answers[-1]})
    return answers


def machine_giving(generator, budget):
    """Make the probe a machine that gives what makes budget.auto_budget `budget` in all, what the plan holds
    included (its free memory grows as the caches give back), and wait for the generation thread to resize to it."""
    elastic = generator.elastic
    total = int((budget + AUTO_RESERVE) / (1 - AUTO_HEADROOM)) + 1
    before = elastic.resizes
    elastic.probe = lambda: Available([Limit("fake probe", max(0, total - elastic.held()))])
    elastic.every = 0
    deadline = time.monotonic() + 30
    while elastic.resizes == before and time.monotonic() < deadline:
        time.sleep(0.05)
    elastic.every = 3600
    assert elastic.resizes == before + 1


def test_shrink_and_grow_mid_conversation(served):
    provider, generator, port = served
    flash = provider.flash
    strides = {k: v.stride for k, v in flash.fd.layouts.items()}
    assert flash.plan.budget is None and generator.elastic is not None  # (this machine holds SmolLM2 whole)
    fixed = conversation(port)
    every = flash.plan.cache_bytes(strides)
    floor = flash.plan.floor(strides)

    def between(turn):
        if turn == 1:  # shrink: the caches keep a quarter of the units
            active = mx.get_active_memory()
            machine_giving(generator, floor + every // 4)
            m = metrics(port)
            assert m["budget_resizes"] == 1 and m["memory_short"] is None
            assert every // 4 - every // 20 <= m["unit_caches"] <= every // 4
            assert active - mx.get_active_memory() >= every // 2  # (given back to the system, not kept by MLX)
        if turn == 2:  # below the floor: a request gets a 503 and the reason; then the machine gives more again
            machine_giving(generator, floor // 2)
            status, r = post(port, [{"role": "user", "content": "hello"}])
            assert status == 503 and "not enough memory" in r["error"] and "fake probe" in r["error"]
            m = metrics(port)
            assert m["memory_short"] and m["unit_caches"] == 0 and m["refused_for_memory"] == 1
            machine_giving(generator, floor + 2 * every)
            m = metrics(port)
            assert m["memory_short"] is None and m["unit_caches"] == every and m["budget_resizes"] == 3

    assert conversation(port, between) == fixed
