"""The server (`python -m mlx_flash.server`, the default model at a 50% budget) against a careless or hostile
client (issue 39): a body larger than --max-context can use is refused before it is read, bad lengths, encodings
and types are answered with a 4xx JSON error, a failed read with a 500 that names no file; each in one log line,
never a traceback, and the server goes on."""

import errno
import http.client
import json
import os
import re
import socket
import subprocess
import sys
import time

from mlx_flash.default_model import default_model_dir
from mlx_flash.errors import ReadError
from mlx_flash.format.directory import FFN
from mlx_flash.server import ModelProvider, serve, setup_arg_parser

import pytest

CONTEXT = 256
BUDGET = "50%"


class Server:
    """`python -m mlx_flash.server` in a child process, its log in a file."""

    def __init__(self, log_path, env=None):
        self.log_path = log_path
        args = ["--model", default_model_dir(), "--memory-budget", BUDGET, "--max-context", CONTEXT, "--port", 0]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlx_flash.server", "--log-level", "INFO", *map(str, args)],
            stderr=open(log_path, "w"),  # noqa: SIM115  (the child's; closed when it exits)
            env=dict(os.environ, **(env or {})),
        )
        deadline = time.monotonic() + 120
        while not (m := re.search(r"serving .* on http://127\.0\.0\.1:(\d+)/v1", self.log())):
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log()
            time.sleep(0.05)
        self.port = int(m.group(1))

    def log(self) -> str:
        return self.log_path.read_text()

    def status(self, field: str) -> int:
        """A field of the child's /proc status, in bytes (VmRSS, VmHWM)."""
        text = open(f"/proc/{self.proc.pid}/status").read()
        return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1)) << 10

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("server") / "log")
    yield s
    s.stop()
    assert "Traceback" not in s.log(), s.log()  # nothing it was sent made a traceback


def request(port, path, body):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    payload = r.read()
    conn.close()
    return r.status, payload


def exchange(port, head: str, body: bytes = b"", timeout: float = 10):
    """Sends a request as written (its headers unchecked, no more body than `body`), the connection left open;
    returns the answer's status and body."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
        r = http.client.HTTPResponse(s)
        r.begin()
        return r.status, r.read()


def post_head(length, path="/v1/completions") -> str:
    return f"POST {path} HTTP/1.1\nHost: x\nContent-Type: application/json\nContent-Length: {length}\n"


def assert_error(payload, pattern):
    """A JSON error body that says what is wrong."""
    assert re.search(pattern, json.loads(payload)["error"]), payload


def assert_serving(server):
    status, payload = request(server.port, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 3})
    assert status == 200 and json.loads(payload)["usage"]["completion_tokens"] == 3


# -- the body's size, before it is read -------------------------------------------------------------------------
def test_a_body_larger_than_the_context_needs_is_refused_unread(server):
    """A 5 MB prompt at --max-context 256: a 413 before the body is read or tokenised, and the server's memory
    stays where it was (mlx-lm read it whole and tokenised it: 195 -> 852 MB, then 598 MB held, and a 404)."""
    body = json.dumps({"prompt": "hello " * ((5 << 20) // 6), "max_tokens": 4}).encode()
    assert_serving(server)
    rss = server.status("VmRSS")
    with open(f"/proc/{server.proc.pid}/clear_refs", "w") as f:
        f.write("5")  # VmHWM from here
    status, payload = exchange(server.port, post_head(len(body)), body, timeout=60)
    assert status == 413
    assert_error(payload, r"request body \(\d+ bytes\) is larger than")
    assert server.status("VmHWM") - rss < 4 << 20
    assert_serving(server)


def test_a_refused_body_is_not_waited_for(server):
    """Its length alone refuses it: the answer comes before the body (the client never sends it)."""
    status, payload = exchange(server.port, post_head(5 << 20), timeout=5)
    assert status == 413


def test_a_prompt_longer_than_the_context_is_413(server):
    status, payload = request(server.port, "/v1/completions", {"prompt": "hello " * CONTEXT, "max_tokens": 4})
    assert status == 413
    assert_error(payload, rf"does not fit the context of {CONTEXT} tokens")


# -- lengths and encodings ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "length, status, pattern",
    [(None, 411, "Content-Length"), ("-1", 400, "Content-Length"), ("1e3", 400, "Content-Length")],
)
def test_a_length_that_is_not_a_count(server, length, status, pattern):
    """No Content-Length, or one that is not a count (mlx-lm read "-1" until the client left): answered at once."""
    head = post_head(length) if length is not None else post_head(0).replace("Content-Length: 0\n", "")
    got, payload = exchange(server.port, head, b'{"prompt": "x"}', timeout=5)
    assert got == status
    assert_error(payload, pattern)
    assert_serving(server)


@pytest.mark.parametrize(
    "body, pattern",
    [
        ('{"prompt": "caf\xe9", "max_tokens": 3}'.encode("latin-1"), "not UTF-8"),
        (b'{"prompt": "a\\ud800b", "max_tokens": 3}', "surrogate"),  # JSON, but not text
        (b'{"prompt": ' + b"[" * 20_000 + b"]" * 20_000 + b"}", "nested too deeply"),
    ],
)
def test_bodies_that_are_not_text(server, body, pattern):
    status, payload = exchange(server.port, post_head(len(body)), body)
    assert status == 400
    assert_error(payload, pattern)


# -- types ----------------------------------------------------------------------------------------------------------
USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "body, pattern",
    [
        ({"messages": [{"role": "user", "content": 123}]}, "content"),
        ({"messages": [{"role": "user", "content": [{"text": "hi"}]}]}, "content"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "content"),
        ({"messages": [{"role": 5, "content": "hi"}]}, "role"),
        ({"messages": [{"content": "hi"}]}, "role"),
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "assistant", "tool_calls": 5}, *USER]}, "tool_calls"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{x"}}]}, *USER]}, "arguments"),
        ({"messages": USER, "tools": 5}, "tools"),
        ({"messages": USER, "stop": 5}, "stop"),
        ({"messages": USER, "stop": [5]}, "stop"),
        ({"messages": USER, "chat_template_kwargs": 5}, "chat_template_kwargs"),
        ({"messages": USER, "stream": True, "stream_options": [1]}, "stream_options"),
        ({"messages": USER, "seed": -1}, "seed"),
        ({"messages": USER, "seed": 1 << 64}, "seed"),
        ({"messages": USER, "top_k": 1 << 40}, "top_k"),
        ({"messages": USER, "logit_bias": {"-99999999": 1}}, "logit_bias"),  # mlx indexes the logits unchecked:
        ({"messages": USER, "logit_bias": {"99999999": 1}}, "logit_bias"),  # a segmentation fault
    ],
)
def test_bad_types_are_400(server, body, pattern):
    """What mlx-lm took and then failed on in its generation thread (a 404), mid-stream (a 500 or an error event,
    with a traceback) or in mlx (the process crashed), refused as it arrives."""
    status, payload = request(server.port, "/v1/chat/completions", {"max_tokens": 3, **body})
    assert status == 400
    assert_error(payload, pattern)


def test_good_requests_still_pass(server):
    """What the checks let through: text parts, tool calls with JSON arguments, stream options without a usage."""
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "What is 2+2?"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "add", "arguments": '{"a": 2}'}}]},
        {"role": "user", "content": "thanks"},
    ]
    body = {"messages": messages, "max_tokens": 3, "stop": ["\n"], "seed": 7, "logit_bias": {"0": -1}}
    status, payload = request(server.port, "/v1/chat/completions", body)
    assert status == 200 and json.loads(payload)["object"] == "chat.completion"
    body = {"messages": USER, "max_tokens": 3, "stream": True, "stream_options": {}}
    status, payload = request(server.port, "/v1/chat/completions", body)
    assert status == 200 and payload.decode().endswith("data: [DONE]\n\n")


# -- a failed read ------------------------------------------------------------------------------------------------
def test_an_injected_read_error_is_a_500_that_names_no_file(tmp_path):
    """MLX_FLASH_FAIL_READ=n fails a read mid-request with EIO: the client gets a 500 whose message names no file
    (the log has the file, in one line), and the next request is served."""
    s = Server(tmp_path / "log", env={"MLX_FLASH_FAIL_READ": "40"})
    try:
        status, payload = request(s.port, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 30})
        assert status == 500
        assert json.loads(payload)["error"] == "ReadError: the model's data could not be read"
        assert "/" not in payload.decode() and FFN not in payload.decode()
        assert_serving(s)
    finally:
        s.stop()
    assert re.search(r"request failed: .*Errno 5.*path=/\S+", s.log()) and "Traceback" not in s.log(), s.log()


class FailingReader:
    """The engine's reader, whose `n`-th wait raises what a failed read raises: a ReadError naming the file."""

    def __init__(self, reader, n: int):
        self.reader, self.n = reader, n

    def __getattr__(self, name):
        return getattr(self.reader, name)

    def wait(self, handle):
        done = self.reader.wait(handle)  # (its buffers are reused once it is done)
        self.n -= 1
        if self.n == 0:
            path = self.reader.path
            raise ReadError(errno.EIO, f"read failed: path={path}, offset=0, length=4096", str(path))
        return done


@pytest.mark.parametrize("stream", [False, True])
def test_a_read_error_names_no_file_in_either_shape(monkeypatch, caplog, stream):
    """The same in-process, the response streamed or not: the client's error names no file, the log's does."""
    args = ["--model", str(default_model_dir()), "--max-context", str(CONTEXT), "--memory-budget", BUDGET]
    provider = ModelProvider(setup_arg_parser().parse_args(args))
    httpd, generator = serve(provider, port=0)
    port, engine = httpd.server_address[1], provider.flash
    try:
        monkeypatch.setattr(engine, "reader", FailingReader(engine.reader, 10))
        status, payload = request(port, "/v1/completions", {"prompt": "abc", "max_tokens": 20, "stream": stream})
        assert engine.reader.n <= 0  # it failed mid-request
        monkeypatch.undo()
        text = payload.decode()
        if stream:  # the 200 went with the first event: the stream ends with the error
            assert status == 200 and json.loads(text.split("data: ")[-1])["type"] == "server_error"
        else:
            assert status == 500
        assert "ReadError: the model's data could not be read" in text and FFN not in text
        assert request(port, "/v1/completions", {"prompt": "abc", "max_tokens": 3})[0] == 200
    finally:
        httpd.shutdown()
        httpd.server_close()
        generator.stop_and_join()
        provider.close()
    assert [r for r in caplog.records if FFN in r.getMessage()] and not [r for r in caplog.records if r.exc_info]
