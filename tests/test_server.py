"""The server (mlx-lm's, on a flash model): round trips, streaming, bad requests, disconnects, read
errors, no leaks, and prompt-cache reuse across chat turns."""

import errno
import http.client
import json
import logging
import os
import socket
import time

from mlx_flash.convert import convert
from mlx_flash.errors import ReadError
from mlx_flash.models.tiny import make_tiny_model_dir

import mlx.core as mx
import pytest

CONTEXT = 128


@pytest.fixture(scope="module")
def server(tmp_path_factory, start_server):
    root = tmp_path_factory.mktemp("srv")
    # vocab 257: id 256 is <|endoftext|>, so the tiny tokenizer has an EOS
    path = convert(str(make_tiny_model_dir("llama", root / "src", vocab_size=257)), root / "tiny", progress=False)
    return start_server(
        ["--model", path, "--max-context", CONTEXT, "--memory-budget", "300%", "--sparsity", "dense",
         "--max-batch", "1"]  # one request at a time: its stats and reads are its own (batching: test_server_batching)
    )  # fmt: skip


def request(port, method, path, body=None, raw=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    payload = r.read()
    conn.close()
    return r.status, payload


def events(payload: bytes):
    return [line[6:] for line in payload.decode().split("\n") if line.startswith("data: ")]


def test_models(server):
    provider, _, port = server
    status, payload = request(port, "GET", "/v1/models")
    assert status == 200 and json.loads(payload)["data"][0]["id"] == provider.name


def test_chat_and_completion_round_trip(server):
    provider, _, port = server
    status, payload = request(
        port, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}
    )
    r = json.loads(payload)
    assert status == 200 and r["object"] == "chat.completion"
    assert r["choices"][0]["message"]["role"] == "assistant"
    assert r["usage"]["completion_tokens"] <= 5 and r["choices"][0]["finish_reason"] in ("length", "stop")
    status, payload = request(
        port, "POST", "/v1/completions", {"prompt": "abc", "max_tokens": 4, "model": provider.name, "logprobs": True}
    )
    r = json.loads(payload)
    assert status == 200 and r["object"] == "text_completion" and r["usage"]["prompt_tokens"] == 3
    assert len(r["choices"][0]["logprobs"]["content"]) == 4  # mlx-lm's logprobs


def test_completion_is_greedy_and_matches_library(server):
    from mlx_lm import generate

    provider, _, port = server
    _, payload = request(port, "POST", "/v1/completions", {"prompt": "abc", "max_tokens": 6})
    assert json.loads(payload)["choices"][0]["text"] == generate(
        provider.model, provider.tokenizer, "abc", max_tokens=6
    )


def test_streaming(server):
    _, _, port = server
    status, payload = request(
        port,
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": True},
    )
    assert status == 200
    ev = events(payload)
    assert ev[-1] == "[DONE]"
    chunks = [json.loads(e) for e in ev[:-1]]
    assert 1 <= len(chunks) <= 7 and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize(
    "raw, status, text",
    [
        (b"{not json", 400, "Invalid JSON"),
        (b"[1, 2]", 400, "JSON dictionary"),
        (json.dumps({"model": "gpt-9", "prompt": "x"}).encode(), 404, "not found"),
        (json.dumps({"prompt": 5}).encode(), 400, "'prompt' must be a string"),
        (json.dumps({"prompt": "x", "max_tokens": -1}).encode(), 400, "max_tokens"),
        (json.dumps({"prompt": "x" * (CONTEXT + 10), "max_tokens": 10}).encode(), 413, "does not fit the context"),
    ],
)
def test_bad_requests(server, raw, status, text):
    _, _, port = server
    got, payload = request(port, "POST", "/v1/completions", raw=raw)
    assert got == status and text in json.loads(payload)["error"]
    assert request(port, "GET", "/v1/models")[0] == 200  # still serving


def test_max_tokens_is_cut_to_the_context(server):
    _, _, port = server
    prompt = "x" * (CONTEXT - 4)
    _, payload = request(port, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 50})
    r = json.loads(payload)
    assert r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"] <= CONTEXT


def test_client_disconnect_stops_generation(server):
    provider, _, port = server
    _, payload = request(port, "POST", "/v1/completions", {"prompt": "abc", "max_tokens": 100})
    assert json.loads(payload)["usage"]["completion_tokens"] == 100  # undisturbed, it runs to the end
    body = json.dumps({"prompt": "abc", "max_tokens": 100, "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    s.recv(200)  # the response has started
    s.close()
    time.sleep(1.0)
    assert len(provider.flash.stats.tokens) < 50  # this request's tokens (the stats restart per request)
    status, _ = request(port, "POST", "/v1/completions", {"prompt": "abc", "max_tokens": 2})
    assert status == 200  # the server goes on, and got its turn: the abandoned generation ended


@pytest.mark.parametrize("stream", [False, True])
def test_a_read_error_fails_the_request_not_the_server(server, monkeypatch, stream):
    provider, _, port = server
    engine, calls = provider.flash, []
    ffn = engine.ffn

    def failing(*args):
        calls.append(1)
        if len(calls) > 4:  # after the prompt and a token or so
            raise ReadError(errno.EIO, "injected EIO", "ffn.bin")
        return ffn(*args)

    monkeypatch.setattr(engine, "ffn", failing)
    status, payload = request(port, "POST", "/v1/completions", {"prompt": "abc", "max_tokens": 20, "stream": stream})
    if stream:  # the 200 was sent with the first event: the stream ends with the error
        assert status == 200 and "ReadError" in json.loads(events(payload)[-1])["error"]
    else:
        assert status == 500 and "ReadError: the model's data could not be read" in json.loads(payload)["error"]
    monkeypatch.undo()
    status, payload = request(port, "POST", "/v1/completions", {"prompt": "abc", "max_tokens": 3})
    assert status == 200 and json.loads(payload)["usage"]["completion_tokens"] == 3


def chat(port, messages, max_tokens=6):
    status, payload = request(port, "POST", "/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens})
    assert status == 200
    r = json.loads(payload)
    return r["choices"][0]["message"]["content"], r["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)


def test_prompt_cache_reuse_gives_the_tokens_of_a_fresh_prefill(server):
    """Each turn after the first prefills only its new tokens (from the stored cache of the last turn)
    and answers exactly as a fresh prefill of the whole history does (greedy)."""
    _, generator, port = server
    messages = [{"role": "user", "content": "a cat story"}]
    for turn in range(3):
        generator.prompt_cache.trim_to(n_sequences=0)  # nothing stored: a fresh prefill
        fresh, cached = chat(port, messages)
        assert cached == 0
        if turn:
            generator.prompt_cache.trim_to(n_sequences=0)
            chat(port, messages[:-2])  # the previous turn again: its cache is stored
            reused, cached = chat(port, messages)
            assert cached > 0 and reused == fresh
        messages += [{"role": "assistant", "content": fresh}, {"role": "user", "content": f"then {turn}?"}]


def test_each_request_logs_its_reads_per_forward_pass(server, caplog):
    """At INFO the server logs a request's device bytes pass by pass (benchmarks/chat.py splits a
    turn's reads with it): its prompt's prefill passes (the last ends with the prompt's last token and
    gives the first generated token), then one single-token pass per further generated token and one
    that feeds the last into the stored prompt cache; together, every byte the request read."""
    provider, _, port = server
    flash = provider.model.flash
    flash.reset()  # cold unit caches: this request reads
    caplog.set_level(logging.INFO)
    prompt = "abcdefghij" * 3
    read0 = flash.stats.device_bytes()
    status, payload = request(port, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 5})
    r = json.loads(payload)
    assert status == 200
    deadline = time.time() + 10  # logged by the generation thread once the request is done
    while not (logged := [m for m in caplog.messages if m.startswith("flash reads: ")]) and time.time() < deadline:
        time.sleep(0.01)
    reads = json.loads(logged[-1][len("flash reads: ") :])
    step = provider.cli_args.prefill_step_size
    assert len(reads["prefill_passes"]) == -(-r["usage"]["prompt_tokens"] // step)
    assert r["choices"][0]["finish_reason"] == "length"  # (the tiny model's greedy reply has no EOS here)
    assert len(reads["decode_passes"]) == r["usage"]["completion_tokens"]
    assert sum(reads["prefill_passes"]) + sum(reads["decode_passes"]) == flash.stats.device_bytes() - read0 > 0


def _open_fds():
    return len(os.listdir("/proc/self/fd"))


def _settled_fds(limit, timeout=5.0):
    """The fd count once handler threads have closed their sockets (they may lag the client by a moment)."""
    deadline = time.monotonic() + timeout
    while _open_fds() > limit and time.monotonic() < deadline:
        time.sleep(0.05)
    return _open_fds()


def test_twenty_requests_do_not_leak(server):
    provider, generator, port = server
    for _ in range(3):
        request(port, "POST", "/v1/completions", {"prompt": "warm", "max_tokens": 4})
    time.sleep(0.2)
    fds, mem = _open_fds(), mx.get_active_memory()
    for i in range(20):
        assert request(port, "POST", "/v1/completions", {"prompt": f"req {i}", "max_tokens": 4})[0] == 200
    assert _settled_fds(fds) <= fds
    assert mx.get_active_memory() <= mem + (1 << 20)
    assert 0 < generator.prompt_cache.nbytes <= provider.flash.plan.prompt_cache  # stored caches, within the plan


def test_openai_client(server):
    openai = pytest.importorskip("openai")
    provider, _, port = server
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
    r = client.chat.completions.create(model=provider.name, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert r.choices[0].message.role == "assistant"
    parts = list(client.completions.create(model=provider.name, prompt="abc", max_tokens=4, stream=True))
    assert parts and parts[0].object == "text_completion"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="abc", max_tokens=2)


def test_prompt_lookup_serves_the_plain_completion(server):
    """`--prompt-lookup`: every request decodes speculatively, with the tokens of plain decoding."""
    provider, _, port = server
    body = {"prompt": "abc abd abc abd abc", "max_tokens": 12, "model": provider.name}
    plain = json.loads(request(port, "POST", "/v1/completions", body)[1])
    provider.cli_args.prompt_lookup = True
    try:
        status, payload = request(port, "POST", "/v1/completions", body)
        spec = provider.model.flash.speculative.summary()
    finally:
        provider.cli_args.prompt_lookup = False
    assert status == 200 and json.loads(payload)["choices"][0]["text"] == plain["choices"][0]["text"]
    assert spec["passes"] > 0 and spec["drafted"] > 0
