"""An OpenAI-compatible HTTP server for a flash model: mlx-lm's server, with the model loaded by
`mlx_flash.load` under a memory budget.

    python -m mlx_flash.server [--model DIR] --memory-budget 50% [--max-context 2048] [--kv-bits 8]

Request handling comes from `mlx_lm.server`: /v1/models, /v1/completions, /v1/chat/completions
(+ "stream": true), /health, the LRU prompt cache (a new chat turn prefills only its new
tokens), stop sequences, logprobs, tool calls and the OpenAI response shapes. This module adds
what a budget needs: the model from `mlx_flash.load`, one request at a time (the neuron caches
are per process), the prompt cache inside the budget, prompts that must fit --max-context (a 413),
and a 5xx JSON error for a request that fails mid-generation (a flash ReadError), after which the
server goes on. Bad input gets a 4xx JSON error before it reaches the model: a body larger than
--max-context can use (refused unread), a bad Content-Length, a body that is not UTF-8, and types
mlx-lm would fail on in its generation thread (a 404) or crash on. No error sent to a client
names a file (the log does). Binds to 127.0.0.1 unless told otherwise. At --log-level INFO each
request logs the device bytes of its forward passes ("flash reads: {json}", see `read_summary`).

Under mlx.launch (`mlx.launch --backend ring -n 2 -- python -m mlx_flash.server ...`) each rank loads a share of
the layers as a pipeline stage (mlx_flash.pipeline, as `python -m mlx_flash.generate` does): rank 0 serves HTTP and
drives every forward pass, the others follow them. There it serves one request at a time (a batch of 1, the
generation loop's passes as in generate, prompt lookup included) and keeps no prompt cache (the other ranks hold
one sequence's KV cache: each request prefills its whole prompt). Stopping rank 0 (Ctrl-C, SIGTERM) stops the
others; a rank lost ends the others with one line (the pipeline's watchdog).
"""

import argparse  # noqa: I001  (mlx_flash before mlx_lm, see below)
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from functools import partial
from http.server import ThreadingHTTPServer
from pathlib import Path

import mlx_flash  # noqa: F401  (before mlx.core: loads OpenBLAS on Linux)

from mlx_lm import server
from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache

from . import pipeline
from .default_model import model_dir
from .budget import auto_budget, is_auto, parse_size
from .engine.batching import BatchModel, FlashBatchGenerator
from .engine.elastic import CHECK_SECONDS, ElasticBudget
from .engine.forward import BACKENDS, Batchable
from .engine.prompt_store import PromptStore, identity
from .errors import BudgetError, FlashError, ReadError
from .generate import stream_generate
from .loader import load
from .engine.sparsity import SPARSITIES

log = logging.getLogger(__name__)

# A request body is bounded before it is read: this many bytes per token of --max-context (a token is a few
# characters, at most 6 bytes each when JSON escapes them) plus room for the rest of the request
BODY_BYTES_PER_TOKEN = 64
BODY_SLACK = 64 << 10
# Of a body refused unread, at most this much is read and dropped: the client sees the answer, not a reset
DISCARD_BYTES = 64 << 20
# Sequences decoded together when --max-batch is not given: as many of these as the budget holds
MAX_BATCH = 8
RETRY_AFTER_S = 1  # what a 503 (the queue full) asks the client to wait
# A request's own options, from its handler thread to ResponseGenerator.generate (called in the same thread)
_request_options = threading.local()


class PromptTooLong(ValueError):
    """A prompt that does not fit --max-context."""


class Refused(BaseException):
    """A request answered with `status`. A BaseException, to pass the `except Exception` with which mlx-lm
    answers any error before generation with a 404."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class ModelProvider(server.ModelProvider):
    """mlx-lm's ModelProvider for one flash directory, loaded at start (a budget that cannot hold
    fails there, not at the first request). A request naming another model gets mlx-lm's 404."""

    def __init__(self, cli_args: argparse.Namespace, loaded=None):
        """loaded: (model, tokenizer) loaded already, as pipeline rank 0's stage (`serve_stage`)."""
        cli_args.model = str(model_dir(cli_args.model))
        self.loaded = loaded
        self.stage = None  # rank 0's pipeline.Stage: its passes drive the other ranks
        super().__init__(cli_args)
        self.name = Path(cli_args.model).name
        self._model_map[self.name] = cli_args.model
        self.load_default()

    def _load(self, model_path, adapter_path=None, draft_model_path=None):
        if model_path != self.cli_args.model:
            raise ValueError(f"model {model_path!r} not found: this server has {self.name!r}")
        if adapter_path is not None or draft_model_path is not None:
            raise ValueError("adapters and draft models are not supported with a flash model")
        args = self.cli_args
        if self.loaded is not None:  # pipeline rank 0: one request at a time through its stage
            (model, tokenizer), batch = self.loaded, 1
            self.stage = model.forward
        else:
            model, tokenizer, batch = self._load_batch(model_path)
        args.max_batch = batch
        self.model_key = (model_path, None, None)
        self.model, self.tokenizer, self.flash = model, tokenizer, model.flash
        # The token ids both the tokenizer and the model's head know: mlx does not bound-check the ids with
        # which logit_bias indexes the logits (one outside crashes the process)
        self.n_tokens = min(len(tokenizer.vocab), getattr(getattr(model, "args", None), "vocab_size", 1 << 62))
        self.processor = self.draft_model = None
        # mlx-lm's BatchGenerator decodes the requests together, a step in one pass (engine.batching) with the
        # prompts' chunks beside, where every layer's cache batches per sequence (forward.Batchable: not a sliding
        # window's or an SSM's); else one request at a time
        self.is_batchable = all(isinstance(c, Batchable) for c in model.make_cache()) and self.stage is None
        self.batch_model = BatchModel(model)
        args.decode_concurrency = batch
        # prompts beside each other in a pass where rows compute alone (engine.batching), else one at a time
        args.prompt_concurrency = batch if model.forward.sequences_alone else 1
        args.prefill_step_size = model.flash.plan.prefill_step(
            model.flash.fd, args.max_context, model.forward.native, lend=False
        )
        if self.stage is not None:  # at most the positions a stage's pass takes
            args.prefill_step_size = min(args.prefill_step_size, self.stage.max_positions)

    def _load_batch(self, model_path):
        """The model, its tokenizer and the largest batch (up to --max-batch or MAX_BATCH) the budget holds."""
        args = self.cli_args
        batch = args.max_batch or MAX_BATCH
        while True:
            try:
                model, tokenizer = load(
                    model_path,
                    memory_budget=args.memory_budget,
                    sparsity=args.sparsity,
                    window=args.window,
                    context=args.max_context,
                    kv_bits=args.kv_bits,
                    kv_group_size=args.kv_group_size,
                    prompt_caches=args.prompt_cache_size,  # the stored caches are planned inside the budget
                    sequences=batch,  # and the KV caches of the sequences decoded together
                    backend=args.backend,
                )
                return model, tokenizer, batch
            except BudgetError:
                if args.max_batch or batch == 1:  # (a batch asked for is not made smaller)
                    raise
                batch -= 1

    def load(self, model_path, adapter_path=None, draft_model_path=None):
        """The model for mlx-lm's BatchGenerator (its single-request path takes `self.model`)."""
        _, tokenizer = super().load(model_path, adapter_path, draft_model_path)
        return self.batch_model, tokenizer

    def close(self):
        self.flash.close()  # mlx-lm's generation thread resets the provider (drops the model) when it stops
        self.reset()


class _Tracked:
    """A request's response queue, as the generation thread sees it: the request is in flight until its last
    response (None, or an error) or until its client leaves (mlx-lm's handler then stops its context)."""

    def __init__(self, queue):
        self.queue, self.in_flight = queue, True

    def put(self, item):
        if isinstance(item, server.GenerationContext):
            stop = item.stop

            def stopped():
                self.in_flight = False
                stop()

            item.stop = stopped
        if item is None or isinstance(item, Exception):
            self.in_flight = False
        self.queue.put(item)


class ResponseGenerator(server.ResponseGenerator):
    """mlx-lm's generation thread, with admission: at most --max-batch requests in flight (their KV caches are in
    the budget); the others wait in the queue, holding no cache, and a request finding --max-queue waiting gets a
    503. Prompt lookup (--prompt-lookup, or a request's "prompt_lookup") is served one request at a time."""

    def __init__(self, model_provider, prompt_cache):
        self._tracked, self._lock = [], threading.Lock()
        self.generated = self.refused_for_memory = 0
        args = model_provider.cli_args
        elastic = is_auto(args.memory_budget) and args.memory_check > 0 and model_provider.stage is None
        self.elastic = ElasticBudget(model_provider.flash, auto_budget, every=args.memory_check) if elastic else None
        self.lost = None  # the PipelineError that ended the generation thread: a pipeline rank lost
        self.on_lost = None  # called then (make_server: the HTTP server shuts down)
        super().__init__(model_provider, prompt_cache)

    @property
    def _is_distributed(self):
        """mlx-lm shares every request with the other ranks of a launch (tensor parallel, or its own pipeline);
        here only rank 0 serves, and the other ranks follow its passes (pipeline.Stage)."""
        return False

    @_is_distributed.setter
    def _is_distributed(self, value):
        pass

    def _run_generate(self):
        # mlx-lm's generation thread ends at a failure in a batched pass: here the requests in flight fail with its
        # error (a 500 each: a flash ReadError, say) and a new loop serves the next ones
        while True:
            try:
                return self._generate()
            except pipeline.PipelineError as e:  # the other ranks are gone: no pass can run (main prints why)
                self.lost = e
                if self.on_lost is not None:
                    self.on_lost()
                return
            except Exception as e:
                log.error("a batched pass failed: %s", e)
                with self._lock:
                    failed, self._tracked = self._tracked, []
                for t in failed:
                    if t.in_flight:
                        t.put(e)

    def in_flight(self) -> int:
        with self._lock:
            self._tracked = [t for t in self._tracked if t.in_flight]
            return len(self._tracked)

    def _next_request(self, timeout=None):
        if self.elastic is not None:  # (between passes: the caches may change size)
            self.elastic.check()
        if self.in_flight() >= self.cli_args.max_batch:
            if timeout:  # (mlx-lm's loop waits here when it has nothing to step)
                time.sleep(timeout)
            return None
        request = super()._next_request(timeout)
        stage = self.model_provider.stage
        if request is None and stage is not None:
            stage.ping()  # idle: the other ranks' watchdogs hear from rank 0
        if request is None:
            return None
        tracked = _Tracked(request[0])
        with self._lock:
            self._tracked.append(tracked)
        return (tracked, *request[1:])

    def _is_batchable(self, args):
        # (--max-batch 1: each request alone, through the generation loop, its reads logged per pass)
        return super()._is_batchable(args) and not args.prompt_lookup and self.cli_args.max_batch > 1

    def metrics(self) -> dict:
        flash = self.model_provider.model.flash
        batch = self.model_provider.batch_model
        return {
            "batch_size": batch.batch_size,
            "largest_batch": batch.largest_batch,
            "in_flight": self.in_flight(),
            "queue": self.requests.qsize(),
            "max_batch": self.cli_args.max_batch,
            "max_queue": self.cli_args.max_queue,
            "backend": self.model_provider.model.forward.name,
            "generated_tokens": self.generated,
            "bytes_read": flash.stats.device_bytes(),
            "baseline_rss": flash.stats.baseline_rss,  # what the budget is above
            "peak_rss_above_baseline": flash.stats.peak_rss(),
            "refused_for_memory": self.refused_for_memory,
            **(self.elastic.metrics() if self.elastic is not None else {"memory_budget": flash.plan.budget}),
        }

    def _count(self, responses):
        for r in responses:
            with self._lock:
                self.generated += 1
            yield r

    def _tokenize(self, tokenizer, request, args):
        prompt, *rest = super()._tokenize(tokenizer, request, args)
        room = self.cli_args.max_context - len(prompt)
        if room < 1:
            raise PromptTooLong(
                f"the prompt ({len(prompt)} tokens) does not fit the context of "
                f"{self.cli_args.max_context} tokens (--max-context)"
            )
        args.max_tokens = min(args.max_tokens, room)  # the KV cache holds max_context tokens, no more
        return (prompt, *rest)

    def generate(self, request, generation_args, progress_callback=None):
        short = self.elastic.short if self.elastic is not None else None
        if short:
            self.refused_for_memory += 1
            raise Refused(503, f"not enough memory for a request: {short}")
        if self.requests.qsize() >= self.cli_args.max_queue and self.in_flight() >= self.cli_args.max_batch:
            raise Refused(503, f"the server is busy: {self.cli_args.max_queue} requests are waiting (--max-queue)")
        lookup = getattr(_request_options, "prompt_lookup", None)
        generation_args.prompt_lookup = self.cli_args.prompt_lookup if lookup is None else lookup
        try:
            ctx, responses = super().generate(request, generation_args, progress_callback)
        except PromptTooLong as e:
            raise Refused(413, str(e)) from None
        return ctx, self._count(responses)

    def _serve_single(self, request, stream):
        stats = self.model_provider.model.flash.stats
        stats.reset()  # per request: a long-running server would otherwise keep every token's stats
        # mlx-lm's handler calls the `stream_generate` of its module: the flash loop has two passes fewer
        lookup = request[2].prompt_lookup
        mlx_lm_generate = server.stream_generate
        server.stream_generate = partial(stream_generate, prompt_lookup=True) if lookup else stream_generate
        try:
            super()._serve_single(request, stream)
        finally:
            server.stream_generate = mlx_lm_generate
            stats.end()
            if log.isEnabledFor(logging.INFO):
                log.info("flash reads: %s", json.dumps(read_summary(stats)))
        stage = self.model_provider.stage
        if stage is not None and stage.error is not None:  # (the request failed with it: a 500)
            raise stage.error


def read_summary(stats) -> dict:
    """A request's device bytes per forward pass, from the runtime's own counters: the prompt's
    prefill passes (several tokens each; the last gives the first generated token), then the
    single-token passes (one per further generated token, and one that feeds the last into the
    stored prompt cache: see `generate.generate_step`)."""
    return {
        "prefill_passes": [t.bytes_read for t in stats.tokens if t.prefill],
        "decode_passes": [t.bytes_read for t in stats.tokens if not t.prefill],
    }


class APIHandler(server.APIHandler):
    def do_POST(self):
        # mlx-lm reads the body whole, as many bytes as announced: refuse a length that is not a count ("-1" would
        # read until the client leaves) or larger than a prompt of --max-context needs, before reading any
        length = self.headers.get("Content-Length")
        limit = BODY_BYTES_PER_TOKEN * self.response_generator.cli_args.max_context + BODY_SLACK
        if length is None:
            return self._refuse(411, "Content-Length header is required")
        if not (length.isascii() and length.isdigit()):
            return self._refuse(400, "Invalid Content-Length header")
        if int(length) > limit:
            message = f"the request body ({length} bytes) is larger than a request of --max-context tokens needs"
            return self._refuse(413, f"{message} ({limit} bytes)", unread=int(length))
        try:
            super().do_POST()
        except UnicodeDecodeError:  # mlx-lm decodes the body outside its `try` for JSON errors
            self._refuse(400, "the request body is not UTF-8")
        except RecursionError:  # JSON nested deeper than Python's parser goes
            self._refuse(400, "the request body is nested too deeply")

    def do_GET(self):
        if self.path == "/metrics":
            return self._json(200, self.response_generator.metrics())
        return super().do_GET()

    def validate_model_parameters(self):
        super().validate_model_parameters()
        self.prompt_lookup = self.body.get("prompt_lookup")
        self._validate("prompt_lookup", bool, optional=True)
        _request_options.prompt_lookup = self.prompt_lookup  # read by ResponseGenerator.generate
        # What mlx-lm takes here but fails on later: in its generation thread (a 404), mid-stream, or in mlx (a crash)
        stop = self.body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
            raise ValueError("stop must be a string or a list of strings")
        self._validate("stream_options", dict, optional=True)
        if self.stream_options is not None:
            self.stream_options.setdefault("include_usage", False)
        self._validate("chat_template_kwargs", dict, optional=True)
        self._validate("seed", int, min_val=0, max_val=(1 << 64) - 1, optional=True)
        n_tokens = self.response_generator.model_provider.n_tokens
        self._validate("top_k", int, min_val=0, max_val=n_tokens - 1)
        if self.logit_bias and not all(0 <= k < n_tokens for k in self.logit_bias):
            raise ValueError(f"logit_bias keys must be token ids, from 0 to {n_tokens - 1}")
        try:
            json.dumps(self.body, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise ValueError("the request holds a lone surrogate (\\ud800 to \\udfff), which is not text") from None

    def handle_models_request(self):
        # mlx-lm lists the Hugging Face cache, whose models this server cannot load
        provider = self.response_generator.model_provider
        data = [{"id": provider.name, "object": "model", "created": self.created, "owned_by": "mlx_flash"}]
        self._json(200, {"object": "list", "data": data})

    def handle_text_completions(self):
        if not isinstance(self.body.get("prompt"), str):
            raise ValueError("'prompt' must be a string")  # noqa: TRY004  (mlx-lm answers a ValueError with a 400)
        return super().handle_text_completions()

    def handle_chat_completions(self):
        check_chat(self.body)  # here, a 400 (mlx-lm applies the chat template in its generation thread: a 404)
        return super().handle_chat_completions()

    def handle_completion(self, request, stop_words):
        try:
            super().handle_completion(request, stop_words)
        except Refused as e:
            self._refuse(e.status, e.message)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client left: mlx-lm's `finally` stopped its generation
        except Exception as e:  # e.g. a flash ReadError mid-generation: this request fails, the server goes on
            if isinstance(e, ReadError):  # the disk's error, in one line: its message names the file, for the log only
                log.error("request failed: %s", e)
                message = "the model's data could not be read"
            elif isinstance(e, pipeline.PipelineError):
                log.error("request failed: %s", e)
                message = "a pipeline rank was lost"
            else:
                log.exception("request failed")
                message = "the request failed on the server"
            self.close_connection = True
            error = {"error": f"{type(e).__name__}: {message}", "type": "server_error"}
            if self.stream:  # the 200 and earlier events are out: end the stream with the error
                self.wfile.write(f"data: {json.dumps(error)}\n\n".encode())
            else:
                self._headers_buffer = []  # mlx-lm's 200 is still buffered (sent by end_headers): drop it
                self._json(500, error)

    def _refuse(self, status: int, message: str, unread: int = 0):
        """Answer `status` with a JSON error, log it in one line and close the connection, after reading and
        dropping the `unread` bytes of the request the client sends anyway (up to DISCARD_BYTES)."""
        log.warning("refused a request (%d): %s", status, message)
        self.close_connection = True
        try:
            self._json(status, {"error": message}, {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else {})
            unread = min(unread, DISCARD_BYTES)
            while unread > 0 and (chunk := self.rfile.read1(min(unread, 1 << 16))):
                unread -= len(chunk)
        except OSError:
            pass  # the client left

    def _json(self, status: int, obj: dict, headers: dict = None):
        data = json.dumps(obj).encode()
        self._set_completion_headers(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, fmt, *args):
        log.debug(fmt, *args)


def check_chat(body: dict):
    """Raises ValueError unless a chat request is what mlx-lm's chat template and content conversion take: a
    non-empty list of messages with a string role, content that is a string, null or a list of text parts (no
    images here), tool calls whose arguments are JSON; tools and role_mapping that are objects."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError("each message must be an object with a string 'role'")
        content = m.get("content")
        parts = content if isinstance(content, list) else [{"type": "text", "text": "" if content is None else content}]
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in parts):
            raise ValueError("a message's 'content' must be a string or a list of {'type': 'text', 'text': string}")
        calls = m.get("tool_calls") or []
        if not (
            isinstance(calls, list)
            and all(isinstance(c, dict) and isinstance(c.get("function", {}), dict) for c in calls)
        ):
            raise ValueError("a message's 'tool_calls' must be a list of objects with a 'function' object")
        for arguments in (c.get("function", {}).get("arguments") for c in calls):
            try:
                if isinstance(arguments, str) and arguments:
                    json.loads(arguments)  # as mlx-lm will
            except ValueError:
                raise ValueError("a tool call's 'arguments' must be JSON") from None
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ValueError("'tools' must be a list of objects")
    if not isinstance(body.get("role_mapping") or {}, dict):
        raise ValueError("'role_mapping' must be an object")


class DiskTieredPromptCache(LRUPromptCache):
    """mlx-lm's prompt cache in memory, each entry it stores also written to --prompt-cache-dir and read back where
    the disk holds a longer prefix than memory: a restarted server (or another process) resumes conversations and
    shared prefixes without prefilling them. Reused as the memory tier reuses (any prefix: the same bits where the
    forward computes rows alone, engine/prompt_store.py)."""

    def __init__(self, max_size: int, max_bytes: int, store: PromptStore, make_cache):
        super().__init__(max_size, max_bytes)
        self.store, self.make_cache = store, make_cache

    def fetch_nearest_cache(self, model, tokens):
        cache, rest = super().fetch_nearest_cache(model, tokens)
        stored, n = self.store.fetch(tokens, self.make_cache, 1, more_than=len(tokens) - len(rest))
        return (cache, rest) if stored is None else (stored, tokens[n:])

    def insert_cache(self, model, tokens, prompt_cache, *, cache_type="assistant"):
        super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)
        if can_trim_prompt_cache(prompt_cache):
            self.store.save(tokens, prompt_cache, 1)


def make_server(provider: ModelProvider, host: str = "127.0.0.1", port: int = 8080):
    """The HTTP server and mlx-lm's generation thread (started) for `provider`.
    Stop with httpd.shutdown(), generator.stop_and_join(), provider.close()."""
    plan = provider.model.flash.plan
    # Every stored cache is one KV cache of --max-context tokens (allocated whole, see loader.make_cache)
    max_bytes = plan.prompt_cache if plan.budget is not None else 1 << 63
    server.BatchGenerator = FlashBatchGenerator  # what mlx-lm's generation thread makes (its steps: one pass each)
    args = provider.cli_args
    if args.prompt_cache_dir and args.prompt_cache_size:
        store = PromptStore(args.prompt_cache_dir, identity(provider.model), parse_size(args.prompt_cache_dir_size))
        prompt_cache = DiskTieredPromptCache(args.prompt_cache_size, max_bytes, store, provider.model.make_cache)
    else:
        prompt_cache = LRUPromptCache(args.prompt_cache_size, max_bytes)
    generator = ResponseGenerator(provider, prompt_cache)
    httpd = ThreadingHTTPServer((host, port), partial(APIHandler, generator), bind_and_activate=False)
    httpd.daemon_threads = True
    # a burst of clients waits in the listen backlog while the generation thread holds the accept loop up:
    # socketserver's backlog of 5 resets the connections beyond it before --max-queue can queue them
    httpd.request_queue_size = max(socket.SOMAXCONN, provider.cli_args.max_queue + provider.cli_args.max_batch)
    try:
        httpd.server_bind()
        httpd.server_activate()
    except OSError:
        httpd.server_close()
        raise
    generator.on_lost = lambda: threading.Thread(target=httpd.shutdown, daemon=True).start()
    return httpd, generator


def serve(provider: ModelProvider, host: str = "127.0.0.1", port: int = 8080):
    """`make_server`, serving in a background thread."""
    httpd, generator = make_server(provider, host, port)
    threading.Thread(target=httpd.serve_forever, daemon=True, name="mlx_flash.server").start()
    return httpd, generator


def setup_arg_parser():
    p = argparse.ArgumentParser(
        description="OpenAI-compatible server for a flash model (mlx-lm's server). Under mlx.launch each rank runs a "
        "pipeline stage and rank 0 serves, one request at a time."
    )
    p.add_argument("--model", default=None, help="Flash directory (default: SmolLM2-135M-Instruct).")
    p.add_argument("--host", default="127.0.0.1", help="Address to bind (default: loopback only).")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument(
        "--memory-budget",
        default="auto",
        help="Bytes, 2GB, 512MiB, 50%% of the model, or auto (the default: what this machine can give now).",
    )
    p.add_argument(
        "--memory-check",
        type=float,
        default=CHECK_SECONDS,
        help="With --memory-budget auto: seconds between asking the machine what it can give (unit caches resized "
        "to it between passes; 0: never).",
    )
    p.add_argument("--sparsity", default="auto", choices=["auto", *SPARSITIES])
    p.add_argument("--window", type=int, default=5)
    p.add_argument(
        "--max-context",
        type=int,
        default=2048,
        help="Prompt + generated tokens per request (sizes the KV cache in the budget).",
    )
    p.add_argument("--kv-bits", type=int, default=None, choices=[4, 8], help="Quantise the KV cache (default: float).")
    p.add_argument("--kv-group-size", type=int, default=64, help="Group size of the quantised KV cache.")
    p.add_argument(
        "--prompt-cache-size",
        type=int,
        default=1,
        help="KV caches kept between requests (each of --max-context tokens, inside the budget; 0: off, as under a "
        "pipeline).",
    )
    p.add_argument(
        "--prompt-cache-dir",
        default=None,
        help="Also keep the stored KV caches in this directory (read back by a restarted server or another process "
        "whose prompt starts the same way; generate's --prompt-cache-dir).",
    )
    p.add_argument(
        "--prompt-cache-dir-size",
        default="8GiB",
        help="The most --prompt-cache-dir holds (the entries used longest ago go first).",
    )
    p.add_argument(
        "--max-batch",
        type=int,
        default=None,
        help=f"Requests decoded together (their KV caches are in the budget; default: up to {MAX_BATCH}, as many as "
        "the budget holds; 1 under a pipeline). More wait in the queue.",
    )
    p.add_argument(
        "--max-queue", type=int, default=64, help="Requests that may wait; one more gets a 503 with Retry-After."
    )
    p.add_argument("--max-tokens", type=int, default=512, help="Default maximum tokens to generate.")
    p.add_argument(
        "--prompt-lookup",
        action="store_true",
        help="Speculative decoding with n-gram drafts from each request's prompt and reply (lossless).",
    )
    p.add_argument("--temp", type=float, default=0.0, help="Default sampling temperature.")
    p.add_argument("--top-p", type=float, default=1.0, help="Default nucleus sampling top-p.")
    p.add_argument(
        "--chat-template-args",
        type=json.loads,
        default={},
        help="JSON arguments for the tokenizer's apply_chat_template.",
    )
    p.add_argument(
        "--allowed-origins",
        type=lambda x: x.split(","),
        default=[],
        help="CORS origins allowed (default: none; '*' for any).",
    )
    p.add_argument(
        "--pipeline",
        action="store_true",
        help="Under mlx.launch: pipeline stages, as mlx_lm.server's (here the only split, so also without it). Rank "
        "0 serves one request at a time through the stages, with no prompt cache.",
    )
    p.add_argument(
        "--pipeline-split",
        default=None,
        help="Under mlx.launch: the layers of each rank, e.g. 12,18 (rank 0 runs the last ones, as mlx-lm's; "
        "default: shares as even in bytes as they can be).",
    )
    p.add_argument(
        "--backend",
        default=None,
        choices=BACKENDS,
        help="The forward pass (as mlx_flash.generate's): auto, mlx (MLX's own ops alone) or native.",
    )
    p.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    # the rest of what mlx-lm's server reads, at its defaults (draft models and adapters are refused)
    p.set_defaults(
        adapter_path=None,
        draft_model=None,
        num_draft_tokens=3,
        trust_remote_code=False,
        chat_template="",
        use_default_chat_template=False,
        top_k=0,
        min_p=0.0,
        decode_concurrency=1,
        prompt_concurrency=1,
        prompt_cache_bytes=None,  # (the prompt cache is bounded by the plan: make_server)
        prefill_step_size=2048,
        quantized_kv_start=0,
    )
    return p


def main(argv=None):
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    if args.max_batch is not None and args.max_batch < 1:
        parser.error(f"--max-batch {args.max_batch}: must be at least 1")
    if args.max_queue < 0:
        parser.error(f"--max-queue {args.max_queue}: must be at least 0")
    logging.basicConfig(level=args.log_level, format="%(asctime)s - %(levelname)s - %(message)s")
    try:
        group = pipeline.init()  # under mlx.launch with 2+ ranks this process is one pipeline stage
        if group is not None:
            return serve_stage(args, group)
        provider = ModelProvider(args)
    except (FlashError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        run(provider, args)
    except OSError as e:  # the address is taken, say
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        provider.close()
    return 0


def run(provider: ModelProvider, args):
    """Serve until interrupted (Ctrl-C, or SIGTERM on a pipeline's rank 0); the generator, stopped."""
    flash = provider.model.flash
    if flash.budget_note:
        print(flash.budget_note, file=sys.stderr)
    print(
        flash.plan.describe(flash.fd.strides, {k: r.n_units for k, r in flash.fd.layers[0].items()}),
        file=sys.stderr,
    )
    httpd, generator = make_server(provider, args.host, args.port)
    stage = provider.stage
    print(
        f"serving {provider.name} on http://{args.host}:{httpd.server_address[1]}/v1 (context {args.max_context} "
        f"tokens, KV cache {args.kv_bits or 'float'}{'-bit' if args.kv_bits else ''}, "
        f"{args.prompt_cache_size} stored in the prompt cache"
        + (f"; pipeline rank 0 of {stage.size}, one request at a time)" if stage is not None else ")"),
        file=sys.stderr,
        flush=True,
    )
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
        generator.stop_and_join()
    return generator


def serve_stage(args, group) -> int:
    """This rank's stage under mlx.launch (module doc): its share of the layers loaded as every rank agrees; rank 0
    serves and drives the passes, the others follow them until rank 0 stops. The exit status: 1 if a rank failed."""
    args.model = str(model_dir(args.model))
    args.prompt_cache_size = 0  # the other ranks hold one sequence's KV cache, not rank 0's stored ones
    if group.rank != 0:  # Ctrl-C under mlx.launch reaches every rank: rank 0 stops the others
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    model, stage, layers, error = None, None, None, None
    try:
        try:
            layers = pipeline.stage_layers(args.model, group, args)
        except (FlashError, ValueError) as e:
            error = e
        pipeline.agree(group, error, timeout=pipeline.LOAD_WAITS * pipeline.TIMEOUT)
        try:
            model, tokenizer = load(
                args.model,
                memory_budget=args.memory_budget,
                sparsity=args.sparsity,
                window=args.window,
                context=args.max_context,
                layers=layers,
                backend=args.backend,
            )
            stage = pipeline.Stage(group, model)
        except (FlashError, ValueError) as e:
            error = e
        pipeline.agree(group, error, timeout=pipeline.LOAD_WAITS * pipeline.TIMEOUT)
        args.max_context = stage.share_context()
        if group.rank == 0:
            lead(args, stage, tokenizer)
        elif stage.follow():
            raise pipeline.PipelineError(
                f"pipeline rank {group.rank}: rank 0 ended with an error (see the error it printed)"
            )
    except (FlashError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if model is not None:
            model.flash.close()
    return 0


def lead(args, stage, tokenizer):
    """Rank 0: serve, then stop the other ranks (their exit status rank 0's); raise what ended it with an error."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stopped, it stops the others too
    status = 1
    try:
        generator = run(ModelProvider(args, loaded=(stage.model, tokenizer)), args)
        if generator.lost is not None:
            raise generator.lost
        status = 0
    finally:
        if stage.error is None:  # (else no rank is left to tell)
            stage.stop(status)


def exit_now(status: int):
    """Leave without the interpreter's finalisation: mlx-lm's generation thread, joined, may still be unwinding its
    native thread-local state, and CPython ends a thread that needs the GIL during finalisation with pthread_exit,
    which aborts the process inside a C++ destructor ("terminate called without an active exception")."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    exit_now(main())
