"""Continuous batching in the server: concurrent requests decode together (mlx-lm's BatchGenerator), each response its
solo response, with admission (--max-batch, --max-queue), disconnects, long prompts joining, stop sequences, logprobs
and prompt lookup per request."""

import http.client
import json
import socket
import threading
import time

from mlx_flash.budget import kv_cache_bytes
from mlx_flash.errors import BudgetError
from mlx_flash.loader import kv_size_of, load
from mlx_flash.server import ModelProvider, serve, setup_arg_parser

import pytest

CONTEXT = 192

TOPICS = ["cats", "the sea", "rockets", "bread", "music", "rivers", "trains", "chess"]
# Tokens an answer: enough for sequences to decode together (a token costs ~0.35 s through MLX's ops on a CPU)
TOKENS = 8


def _serve(path, *flags):
    args = setup_arg_parser().parse_args(
        ["--model", str(path), "--max-context", str(CONTEXT), "--memory-budget", "150%", *flags]
    )
    provider = ModelProvider(args)
    httpd, generator = serve(provider, port=0)
    return provider, generator, httpd


@pytest.fixture(scope="module")
def server(smol):
    provider, generator, httpd = _serve(smol, "--max-batch", "4", "--prompt-cache-size", "0")
    yield provider, generator, httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()
    generator.stop_and_join()
    provider.close()


def post(port, body, path="/v1/chat/completions"):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    out = r.status, dict(r.getheaders()), r.read()
    conn.close()
    return out


def chat(port, i, max_tokens=TOKENS, **extra):
    body = {
        "messages": [{"role": "user", "content": f"Write about {TOPICS[i % len(TOPICS)]}."}],
        "max_tokens": max_tokens,
        "logprobs": True,
        **extra,
    }
    status, _, payload = post(port, body)
    assert status == 200, payload
    r = json.loads(payload)["choices"][0]
    return r["message"]["content"], [c["logprob"] for c in r["logprobs"]["content"]], r["finish_reason"]


def together(fn, n):
    """fn(i) for i < n, all at once."""
    out = [None] * n
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, fn(i))) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def metrics(port):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    return json.loads(conn.getresponse().read())


def test_the_listen_backlog_holds_every_request_the_queue_admits(smol):
    """A burst of clients arriving while the accept loop is held up (the generation thread computing) waits in the
    listen backlog: socketserver's default of 5 reset the connections beyond it (3 of 9 late clients of a benchmark's
    16 concurrent requests) before --max-queue could queue them."""
    provider, generator, httpd = _serve(smol, "--max-batch", "2", "--max-queue", "200")
    try:
        assert httpd.request_queue_size >= 202
        assert metrics(httpd.server_address[1])["max_queue"] == 200
    finally:
        httpd.shutdown()
        httpd.server_close()
        generator.stop_and_join()
        provider.close()


def test_concurrent_requests_are_batched_and_each_is_its_solo_run(server):
    provider, _, port = server
    assert provider.is_batchable
    solo = [chat(port, i) for i in range(3)]
    assert metrics(port)["largest_batch"] == 1
    m0 = metrics(port)
    assert together(lambda i: chat(port, i), 3) == solo  # text, logprobs and finish reasons
    m = metrics(port)
    assert m["largest_batch"] >= 2 and m["in_flight"] == 0 and m["baseline_rss"] > 0
    assert m["generated_tokens"] - m0["generated_tokens"] == sum(len(s[1]) for s in solo)


def test_stop_sequences_and_logprobs_per_request(server):
    _, _, port = server
    # (topic 0's answer, "Cats - the most ...", meets " the" within its first tokens: it stops while the others decode)
    asks = [dict(stop=[".", " the"]), dict(top_logprobs=3), dict(temperature=0.0)]
    solo = [chat(port, i, **a) for i, a in enumerate(asks)]
    assert together(lambda i: chat(port, i, **asks[i]), 3) == solo
    plain = chat(port, 0)
    assert plain[2] == "length" and solo[0][2] == "stop" and len(solo[0][1]) < len(plain[1])  # the stop acted
    assert len(solo[1][1]) == TOKENS and solo[1][0] == chat(port, 1)[0]


def test_a_long_prompt_joins_a_running_batch(server):
    """A prompt of several prefill chunks sent while two others decode: all equal their solo runs."""
    provider, _, port = server
    long = {"messages": [{"role": "user", "content": "Summarise: " + "the cat sat on the mat and " * 6}]}
    long_ask = lambda: chat(port, 0, messages=long["messages"])  # noqa: E731
    prompt = provider.tokenizer.apply_chat_template(long["messages"], add_generation_prompt=True)
    assert len(prompt) > 2 * provider.cli_args.prefill_step_size  # (at least three chunks)
    solo = [chat(port, i, max_tokens=16) for i in range(2)] + [long_ask()]

    def run(i):
        if i < 2:
            return chat(port, i, max_tokens=16)
        deadline = time.time() + 60
        while metrics(port)["in_flight"] < 2 and time.time() < deadline:
            time.sleep(0.01)
        return long_ask()  # the others are decoding

    assert together(run, 3) == solo


def test_prompt_lookup_and_plain_requests_mixed(server):
    """Prompt lookup (lossless, served alone) and plain requests at once: each gives the plain request's tokens."""
    _, _, port = server
    plain = [chat(port, i) for i in range(3)]
    got = together(lambda i: chat(port, i, prompt_lookup=i % 2 == 0), 3)
    assert [g[0] for g in got] == [p[0] for p in plain]
    status, _, payload = post(port, {"messages": [{"role": "user", "content": "x"}], "prompt_lookup": "yes"})
    assert status == 400 and b"prompt_lookup" in payload


def test_a_client_leaving_mid_batch_frees_its_slot(server):
    provider, _, port = server
    solo = chat(port, 1, max_tokens=12)
    body = json.dumps(
        {"messages": [{"role": "user", "content": "Write about cats."}], "max_tokens": 150, "stream": True}
    ).encode()

    def leave():
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        s.recv(300)  # streaming has begun
        s.close()

    def run(i):
        if i == 0:
            return leave()
        time.sleep(0.2)
        return chat(port, 1, max_tokens=12)

    _, other = together(run, 2)
    assert other == solo  # the one that stayed is undisturbed
    deadline = time.time() + 30
    while metrics(port)["in_flight"] and time.time() < deadline:
        time.sleep(0.2)
    assert metrics(port)["in_flight"] == 0


def test_admission_and_a_full_queue(smol):
    """--max-batch 2: three requests all answered, never more than two decoded together; --max-queue 0 with the batch
    full: a 503 with Retry-After, and the server goes on."""
    provider, generator, httpd = _serve(smol, "--max-batch", "2", "--max-queue", "0", "--prompt-cache-size", "0")
    port = httpd.server_address[1]
    try:
        fd = provider.model.flash.fd
        assert provider.model.flash.plan.kv_cache == 2 * kv_cache_bytes(fd.config, CONTEXT, kv_size_of(fd))
        first = threading.Thread(target=lambda: chat(port, 0, max_tokens=32))
        second = threading.Thread(target=lambda: chat(port, 1, max_tokens=32))
        first.start()
        second.start()
        deadline = time.time() + 60
        while metrics(port)["in_flight"] < 2 and time.time() < deadline:
            time.sleep(0.05)
        status, headers, payload = post(port, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert status == 503 and headers.get("Retry-After") == "1" and b"--max-queue" in payload
        first.join()
        second.join()
        generator.cli_args.max_queue = 8
        assert all(r[0] for r in together(lambda i: chat(port, i, max_tokens=8), 3))
        assert metrics(port)["largest_batch"] == 2
    finally:
        httpd.shutdown()
        httpd.server_close()
        generator.stop_and_join()
        provider.close()


def test_the_budget_holds_the_batch_kv(smol):
    """The plan holds --max-batch KV caches; without --max-batch, as many (up to 8) as the budget holds."""
    one, _ = load(smol, memory_budget="150%", context=CONTEXT, sequences=1)
    four, _ = load(smol, memory_budget="150%", context=CONTEXT, sequences=4)
    try:
        assert four.flash.plan.kv_cache == 4 * one.flash.plan.kv_cache
        strides = {k: v.stride for k, v in four.flash.fd.layouts.items()}
        assert four.flash.plan.nbytes(strides) <= four.flash.plan.budget
    finally:
        one.flash.close()
        four.flash.close()
    args = setup_arg_parser().parse_args(["--model", str(smol), "--max-context", "1024", "--memory-budget", "150%"])
    provider = ModelProvider(args)
    try:
        assert 1 <= args.max_batch < 8  # 8 KV caches of 1024 tokens do not fit 150% of SmolLM2
        assert provider.model.flash.plan.kv_cache == args.max_batch * kv_cache_bytes(
            provider.flash.fd.config, 1024, kv_size_of(provider.flash.fd)
        )
    finally:
        provider.close()
    with pytest.raises(BudgetError):  # twice as many do not fit
        load(smol, memory_budget="150%", context=1024, sequences=2 * args.max_batch, prompt_caches=1)
