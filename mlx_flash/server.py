"""An OpenAI-compatible HTTP server for a flash model.

    python -m mlx_flash.server [--model DIR] --memory-budget 65% [--port 8080]

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (both
with "stream": true for server-sent events). Responses follow the shapes of
mlx-lm's server (and OpenAI's). Requests are served one at a time (the neuron
caches and the engine are per model), the others wait in order. A client that
disconnects stops its generation; a failed request never stops the server.
Binds to 127.0.0.1 unless told otherwise.
"""

import argparse
import json
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import mlx_flash  # noqa: F401  (before mlx.core: loads OpenBLAS on Linux)

from .errors import FlashError


class RequestError(Exception):
    def __init__(self, status: int, message: str, code: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.code = status, code


class ModelService:
    """One loaded model; `generate` runs one request at a time (a fair lock: FIFO order)."""

    def __init__(self, path, max_context: int = 2048, **load_kwargs):
        from .default_model import default_model_dir
        from .loader import load

        self.path = Path(path) if path else default_model_dir()
        self.name = self.path.name
        self.max_context = max_context
        self.model, self.tokenizer = load(self.path, context=max_context, **load_kwargs)
        self._queue = []
        self._queue_cv = threading.Condition()
        self.created = int(time.time())

    def close(self):
        self.model.flash.close()

    def _turn(self):
        """FIFO turn-taking: a ticket per request, served in arrival order."""
        ticket = object()
        with self._queue_cv:
            self._queue.append(ticket)
            self._queue_cv.wait_for(lambda: self._queue[0] is ticket)
        return ticket

    def _done(self, ticket):
        with self._queue_cv:
            self._queue.remove(ticket)
            self._queue_cv.notify_all()

    def prompt_tokens(self, body: dict, chat: bool):
        tok = self.tokenizer
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("content"), str) and "role" in m for m in messages
            ):
                raise RequestError(400, "'messages' must be a non-empty list of {role, content} objects")
            if tok.chat_template is not None:
                return list(tok.apply_chat_template(messages, add_generation_prompt=True))
            return tok.encode("\n".join(m["content"] for m in messages))
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise RequestError(400, "'prompt' must be a string")
        return tok.encode(prompt)

    def generate(self, tokens, max_tokens: int, temperature: float, top_p: float, stop):
        """Yield (text segment, finish_reason or None, generation response) under the model's turn."""
        from mlx_lm import stream_generate
        from mlx_lm.sample_utils import make_sampler

        ticket = self._turn()
        try:
            text = ""
            flash = self.model.flash
            for r in stream_generate(
                self.model, self.tokenizer, tokens, max_tokens=max_tokens, sampler=make_sampler(temperature, top_p),
                prefill_step_size=flash.plan.prefill_step(flash.fd.config, self.max_context),  # within the budget
            ):
                text += r.text
                hit = next((s for s in stop if s in text), None)
                if hit is not None:
                    cut = text.index(hit)
                    yield r.text[: max(0, len(r.text) - (len(text) - cut))], "stop", r
                    return
                yield r.text, r.finish_reason, r
        finally:
            self._done(ticket)


def _params(body: dict, service: ModelService, n_prompt: int):
    def number(key, default, kind, lo, hi):
        v = body.get(key, default)
        if v is None:
            v = default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and int(v) != v) or not lo <= v <= hi:
            raise RequestError(400, f"'{key}' must be a {kind.__name__} in [{lo}, {hi}]")
        return kind(v)

    max_tokens = number("max_tokens", 256, int, 1, service.max_context)
    if n_prompt + max_tokens > service.max_context:
        raise RequestError(
            400,
            f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceeds the context of {service.max_context} tokens",
            "context_length_exceeded",
        )
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(400, "'stop' must be a string or a list of strings")
    return dict(
        max_tokens=max_tokens,
        temperature=number("temperature", 0.0, float, 0.0, 10.0),
        top_p=number("top_p", 1.0, float, 0.0, 1.0),
        stop=stop,
    )


def make_handler(service: ModelService):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # quiet; errors are still answered as JSON
            pass

        # -- helpers ---------------------------------------------------------
        def _json(self, status: int, obj: dict):
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, message: str, code: str = "invalid_request_error"):
            self._json(status, {"error": {"message": message, "type": code, "code": status}})

        def _body(self) -> dict:
            try:
                length = int(self.headers.get("Content-Length", 0))
            except ValueError:
                raise RequestError(400, "bad Content-Length") from None
            try:
                body = json.loads(self.rfile.read(length) or b"null")
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise RequestError(400, f"malformed JSON: {e}") from None
            if not isinstance(body, dict):
                raise RequestError(400, "the request body must be a JSON object")
            model = body.get("model")
            if model not in (None, "", "default", service.name, str(service.path)):
                raise RequestError(404, f"model {model!r} not found (this server has {service.name!r})", "model_not_found")
            return body

        # -- routes ------------------------------------------------------------
        def do_GET(self):
            if self.path.rstrip("/") in ("/v1/models", "/models"):
                self._json(200, {"object": "list", "data": [
                    {"id": service.name, "object": "model", "created": service.created, "owned_by": "mlx_flash"}
                ]})
            elif self.path.rstrip("/") in ("/health", ""):
                self._json(200, {"status": "ok"})
            else:
                self._error(404, f"no route {self.path}", "not_found")

        def do_POST(self):
            route = self.path.rstrip("/")
            chat = route in ("/v1/chat/completions", "/chat/completions")
            if not chat and route not in ("/v1/completions", "/completions"):
                return self._error(404, f"no route {self.path}", "not_found")
            try:
                body = self._body()
                tokens = service.prompt_tokens(body, chat)
                params = _params(body, service, len(tokens))
                stream = bool(body.get("stream", False))
            except RequestError as e:
                return self._error(e.status, str(e), e.code)
            rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
            try:
                if stream:
                    self._stream(rid, chat, tokens, params)
                else:
                    self._complete(rid, chat, tokens, params)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True  # the client left: generation already stopped
            except Exception as e:  # any failure answers this request only; the server goes on
                self.close_connection = True
                if not getattr(self, "_sent_headers", False):
                    self._error(500, f"{type(e).__name__}: {e}", "server_error")

        def _choice(self, chat, text, finish, delta=False):
            if chat:
                key = "delta" if delta else "message"
                return {"index": 0, key: {"role": "assistant", "content": text}, "finish_reason": finish, "logprobs": None}
            return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}

        def _envelope(self, rid, chat, choice, stream):
            obj = ("chat.completion.chunk" if stream else "chat.completion") if chat else "text_completion"
            return {"id": rid, "object": obj, "created": int(time.time()), "model": service.name, "choices": [choice]}

        def _complete(self, rid, chat, tokens, params):
            text, finish, n = "", "length", 0
            for seg, fin, _ in service.generate(tokens, **params):
                text += seg
                n += 1
                if fin:
                    finish = fin
            resp = self._envelope(rid, chat, self._choice(chat, text, finish), False)
            resp["usage"] = {"prompt_tokens": len(tokens), "completion_tokens": n, "total_tokens": len(tokens) + n}
            self._json(200, resp)

        def _stream(self, rid, chat, tokens, params):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            self._sent_headers = True
            self.close_connection = True
            gen = service.generate(tokens, **params)
            try:
                for seg, fin, _ in gen:
                    chunk = self._envelope(rid, chat, self._choice(chat, seg, fin, delta=True), True)
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
            finally:
                gen.close()  # a disconnect (write error) ends the generation here

    return Handler


def serve(service: ModelService, host: str = "127.0.0.1", port: int = 8080) -> ThreadingHTTPServer:
    """Start serving in a background thread; returns the server (server.shutdown() to stop)."""
    httpd = ThreadingHTTPServer((host, port), make_handler(service))
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True, name="mlx_flash.server").start()
    return httpd


def setup_arg_parser():
    p = argparse.ArgumentParser(description="OpenAI-compatible server for a flash model.")
    p.add_argument("--model", default=None, help="Flash directory (default: SmolLM2-135M-Instruct).")
    p.add_argument("--host", default="127.0.0.1", help="Address to bind (default: loopback only).")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--memory-budget", default=None, help="Bytes, 2GB, 512MiB or 50%% of the model.")
    p.add_argument("--sparsity", default="auto", choices=["auto", "dense", "oracle", "predictor", "dip"])
    p.add_argument("--window", type=int, default=5)
    p.add_argument("--max-context", type=int, default=2048, help="Prompt + generated tokens per request (sizes the KV cache).")
    return p


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    try:
        service = ModelService(args.model, args.max_context, memory_budget=args.memory_budget,
                               sparsity=args.sparsity, window=args.window)
    except (FlashError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    httpd = ThreadingHTTPServer((args.host, args.port), make_handler(service))
    print(f"serving {service.name} on http://{args.host}:{httpd.server_address[1]}/v1", file=sys.stderr, flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
        service.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
