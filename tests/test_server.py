"""The OpenAI-compatible server: round trips, streaming, bad requests, disconnects, no leaks."""

import http.client
import json
import os
import socket
import time

import mlx.core as mx
import pytest

from mlx_flash.convert import convert
from mlx_flash.models.tiny import make_tiny_model_dir
from mlx_flash.server import ModelService, serve


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("srv")
    # vocab 257: id 256 is <|endoftext|>, so the tiny tokenizer has an EOS
    path = convert(str(make_tiny_model_dir("llama", root / "src", vocab_size=257)), root / "tiny", progress=False)
    service = ModelService(path, max_context=128, memory_budget="300%", sparsity="dense")
    httpd = serve(service, port=0)
    yield service, httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()
    service.close()


def request(port, method, path, body=None, raw=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    payload = r.read()
    conn.close()
    return r.status, payload


def test_models(server):
    service, port = server
    status, payload = request(port, "GET", "/v1/models")
    assert status == 200 and json.loads(payload)["data"][0]["id"] == service.name


def test_chat_and_completion_round_trip(server):
    service, port = server
    status, payload = request(port, "POST", "/v1/chat/completions",
                              {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 5})
    r = json.loads(payload)
    assert status == 200 and r["object"] == "chat.completion"
    assert r["choices"][0]["message"]["role"] == "assistant" and isinstance(r["choices"][0]["message"]["content"], str)
    assert r["usage"]["completion_tokens"] <= 5 and r["choices"][0]["finish_reason"] in ("length", "stop")
    status, payload = request(port, "POST", "/v1/completions", {"prompt": "abc", "max_tokens": 4, "model": service.name})
    r = json.loads(payload)
    assert status == 200 and r["object"] == "text_completion" and r["usage"]["prompt_tokens"] == 3


def test_completion_is_greedy_and_matches_library(server):
    from mlx_lm import generate

    service, port = server
    _, payload = request(port, "POST", "/v1/completions", {"prompt": "abc", "max_tokens": 6})
    assert json.loads(payload)["choices"][0]["text"] == generate(service.model, service.tokenizer, "abc", max_tokens=6)


def test_streaming(server):
    _, port = server
    status, payload = request(port, "POST", "/v1/chat/completions",
                              {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": True})
    assert status == 200
    events = [line[6:] for line in payload.decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert 1 <= len(chunks) <= 6 and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize(
    "raw, status, text",
    [
        (b"{not json", 400, "malformed JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (json.dumps({"model": "gpt-9", "prompt": "x"}).encode(), 404, "not found"),
        (json.dumps({"prompt": 5}).encode(), 400, "'prompt' must be a string"),
        (json.dumps({"prompt": "x", "max_tokens": -1}).encode(), 400, "max_tokens"),
        (json.dumps({"prompt": "x" * 200, "max_tokens": 10}).encode(), 400, "exceeds the context"),
    ],
)
def test_bad_requests(server, raw, status, text):
    _, port = server
    got, payload = request(port, "POST", "/v1/completions", raw=raw)
    assert got == status and text in json.loads(payload)["error"]["message"]
    assert request(port, "GET", "/v1/models")[0] == 200  # still serving


def test_client_disconnect_stops_generation(server):
    service, port = server
    _, payload = request(port, "POST", "/v1/completions", {"prompt": "abc", "max_tokens": 100})
    assert json.loads(payload)["usage"]["completion_tokens"] == 100  # undisturbed, it runs to the end
    stats = service.model.flash.stats
    before = len(stats.tokens)
    body = json.dumps({"prompt": "abc", "max_tokens": 100, "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    s.recv(200)  # headers and the first event have started
    s.close()
    time.sleep(1.0)
    status, _ = request(port, "POST", "/v1/completions", {"prompt": "abc", "max_tokens": 2})
    assert status == 200  # the server goes on, and got its turn: the abandoned generation ended
    assert len(stats.tokens) - before < 50


def _open_fds():
    return len(os.listdir("/proc/self/fd"))


def _settled_fds(limit, timeout=5.0):
    """The fd count once handler threads have closed their sockets (they may lag the client by a moment)."""
    deadline = time.monotonic() + timeout
    while _open_fds() > limit and time.monotonic() < deadline:
        time.sleep(0.05)
    return _open_fds()


def test_twenty_requests_do_not_leak(server):
    _, port = server
    for _ in range(3):
        request(port, "POST", "/v1/completions", {"prompt": "warm", "max_tokens": 4})
    time.sleep(0.2)
    fds, mem = _open_fds(), mx.get_active_memory()
    for i in range(20):
        assert request(port, "POST", "/v1/completions", {"prompt": f"req {i}", "max_tokens": 4})[0] == 200
    assert _settled_fds(fds) <= fds
    assert mx.get_active_memory() <= mem + (1 << 20)


def test_openai_client(server):
    openai = pytest.importorskip("openai")
    service, port = server
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
    r = client.chat.completions.create(model=service.name, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert r.choices[0].message.role == "assistant"
    parts = list(client.completions.create(model=service.name, prompt="abc", max_tokens=4, stream=True))
    assert parts and parts[0].object == "text_completion"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="abc", max_tokens=2)
