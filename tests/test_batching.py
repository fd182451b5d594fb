"""Continuous batching: the forward's batched pass (native or MLX's) gives each sequence what a pass of it alone gives,
bit for bit; the server decodes concurrent requests together (mlx-lm's BatchGenerator), each response its solo response,
with admission (--max-batch, --max-queue), disconnects, long prompts joining, stop sequences, logprobs and prompt
lookup per request."""

import copy
import http.client
import json
import socket
import threading
import time

from mlx_flash.budget import kv_cache_bytes, min_budget
from mlx_flash.engine.batching import BatchModel, FlashBatchGenerator
from mlx_flash.engine.forward import FloatKVCache, HalfKVCache, SequenceBatch
from mlx_flash.engine.native_step import HostKVCache
from mlx_flash.errors import BudgetError
from mlx_flash.format.directory import FlashDir
from mlx_flash.loader import kv_size_of, load
from mlx_flash.server import ModelProvider, serve, setup_arg_parser

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator

CONTEXT = 192


def _solo(model, prompt, steps):
    """Logits of a prompt's last token, then of `steps` greedy decode steps, the sequence alone."""
    cache = model.make_cache()
    out = [np.array(model.forward(prompt, cache, prompt=True))[0, -1]]
    for _ in range(steps):
        out.append(np.array(model.forward([int(out[-1].argmax())], cache))[0, -1])
    return out


def _batched(model, prompts, steps):
    """The same, the prompts prefilled together right-padded (as mlx-lm's BatchGenerator does) and decoded together."""
    cache = [type(layer[0]).merge(list(layer)) for layer in zip(*[model.make_cache() for _ in prompts])]
    n = max(len(p) for p in prompts)
    for c in cache:
        c.prepare(lengths=[len(p) for p in prompts], right_padding=[n - len(p) for p in prompts])
    padded = mx.array([p + [0] * (n - len(p)) for p in prompts])
    out = [[row] for row in np.array(model.forward.batch(padded, cache))[:, 0]]
    for c in cache:
        c.finalize()
    for _ in range(steps):
        tokens = mx.array([[int(o[-1].argmax())] for o in out])
        for o, row in zip(out, np.array(model.forward.batch(tokens, cache))[:, 0]):
            o.append(row)
    return out


@pytest.mark.parametrize("which", ["smol", "tiny_qwen3_moe"])
def test_a_batched_pass_is_each_sequence_alone(which, request):
    """Prompts of different lengths, prefilled and decoded together: each sequence's logits are its solo logits, bit
    for bit, and the batch reads its units once (fewer bytes than the sequences alone)."""
    path = request.getfixturevalue(which)
    fd = FlashDir(path)
    # SmolLM2: most units streamed; the MoE: two expert slots a layer
    budget = (
        "60%"
        if which == "smol"
        else min_budget(fd, 64, kv_size_of(fd)) + 2 * len(fd.layers) * fd.layouts["experts"].stride
    )
    model, _ = load(path, memory_budget=budget, context=64)
    try:
        assert all(isinstance(c, SequenceBatch) for c in _batch_caches(model, 2)), model.forward.name
        prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [40, 41], [7, 250, 12, 99, 5], [255, 3, 80, 17, 23, 9, 11]]
        stats = model.flash.stats
        before = stats.device_bytes()
        solo = [_solo(model, p, 6) for p in prompts]
        alone = stats.device_bytes() - before
        before = stats.device_bytes()
        together = _batched(model, prompts, 6)
        batched = stats.device_bytes() - before
    finally:
        model.flash.close()
    for s, t in zip(solo, together):
        assert len(s) == len(t) and all(np.array_equal(a, b) for a, b in zip(s, t))
    # dense: every streamed unit once for all; MoE: the union of the sequences' experts (of 8, 2 cached)
    assert batched < (0.6 if which == "smol" else 0.95) * alone


def _batch_caches(model, n):
    return [type(layer[0]).merge(list(layer)) for layer in zip(*[model.make_cache() for _ in range(n)])]


def test_batch_caches_join_leave_and_are_stored_apart():
    a, b, c = HostKVCache(16), HostKVCache(16), HostKVCache(16)
    for i, x in enumerate((a, b, c)):
        x.reserve(4, 2, 8)
        x._k[:] = i
        x.offset = 4
    batch = HostKVCache.merge([a, b])
    assert isinstance(batch, SequenceBatch)
    batch.extend(HostKVCache.merge([c]))
    batch.filter([0, 2])
    assert batch.caches == [a, c] and batch.nbytes == a.nbytes + c.nbytes
    stored = batch.extract(1)  # handed out, not copied (a finishing sequence leaves without a copy) ...
    assert stored is c
    batch.own([1])  # ... until the batch writes there again
    batch.caches[1]._k[:] = 9
    assert stored.offset == 4 and np.all(np.array(stored.keys) == 2) and batch.caches[1].offset == 4
    assert copy.deepcopy(batch).caches[0] is a  # mlx-lm copies a batch to split it: no sequence's KV doubled
    batch.prepare(lengths=[3, 1], right_padding=[0, 2])
    assert batch.lengths(2) == [2, 1]
    batch.advance(2)
    assert batch.lengths(2) == [1, 0]
    with pytest.raises(ValueError, match="left-padded"):
        batch.prepare(left_padding=[0, 1])


@pytest.mark.parametrize("kind", [FloatKVCache, HalfKVCache])
def test_mlx_caches_handed_out_are_copied_before_the_batch_writes(kind):
    """MLX's caches in a batch: a sequence's cache handed to the prompt cache keeps what it held when the batch
    writes that sequence again (MLX arrays are written in place by slice assignment)."""
    a, b = kind(), kind()
    for i, c in enumerate((a, b)):
        c.update_and_fetch(*(mx.full((1, 2, 3, 8), float(i)),) * 2)
    batch = kind.merge([a, b])
    stored = batch.extract(0)
    batch.own([0])
    batch.caches[0].update_and_fetch(mx.full((1, 2, 1, 8), 9.0), mx.full((1, 2, 1, 8), 9.0))
    assert stored.offset == 3 and float(stored.keys[..., :3, :].max()) == 0.0 and batch.caches[0].offset == 4


def _generate_all(generator_class, model, prompts, max_tokens, step, late=()):
    """Greedy tokens of each prompt from mlx-lm's BatchGenerator (prompts prefilled one at a time, as the server's
    were) or the flash one, both over the model's forward, the prompts in `late` inserted after the others' third
    step, and the passes it ran (each one's tokens per sequence)."""
    passes = []
    forward = model.forward
    run = forward.run
    forward.run = lambda seqs, prompt=False: passes.append([len(t) for t, _ in seqs]) or run(seqs, prompt)
    try:
        gen = generator_class(
            BatchModel(model),
            completion_batch_size=4,
            prefill_batch_size=4 if generator_class is FlashBatchGenerator and model.forward.sequences_alone else 1,
            prefill_step_size=step,
        )
        first = [p for i, p in enumerate(prompts) if i not in late]
        uids = dict(zip(gen.insert(first, max_tokens=[max_tokens] * len(first)), first))
        out, steps = {}, 0
        while True:
            steps += 1
            if steps == 3 and late:
                later = [prompts[i] for i in late]
                uids.update(zip(gen.insert(later, max_tokens=[max_tokens] * len(later)), later))
            responses = gen.next_generated()
            if not responses:
                break
            for r in responses:
                out.setdefault(prompts.index(uids[r.uid]), []).append(r.token)
        gen.close()
    finally:
        forward.run = run
    return [out[i] for i in range(len(prompts))], passes


@pytest.mark.parametrize("which, step", [("smol", 16), ("smol", 48), ("tiny_qwen3_moe", 16)])
@pytest.mark.parametrize("late", [(), (2, 3)])
def test_a_step_is_one_pass_with_the_prompts_beside(which, step, late, request):
    """FlashBatchGenerator: each step of mlx-lm's BatchGenerator is one pass (the generating sequences, the prompts
    joining them and prompt chunks in the positions left), each sequence's tokens its solo greedy ones, in fewer
    passes than mlx-lm's schedule (a pass for the decode step, one for a prompt chunk, one per joining prompt);
    prompts inserted while others decode join the running batch. Where a pass's rows are not each computed alone
    (the native step's MoE router), mlx-lm's schedule."""
    path = request.getfixturevalue(which)
    fd = FlashDir(path)
    # SmolLM2: most units streamed; the MoE: two expert slots a layer beside 4 sequences' KV caches
    budget = (
        "60%"
        if which == "smol"
        else min_budget(fd, 4 * CONTEXT, kv_size_of(fd)) + 2 * len(fd.layers) * fd.layouts["experts"].stride
    )
    model, _ = load(path, memory_budget=budget, context=CONTEXT, sequences=4)
    try:
        prompts = [list(range(5, 45)), [40, 41] * 12, [7, 250, 12, 99, 5, 8, 9, 10, 11], list(range(200, 233))]
        solo = [[int(logits.argmax()) for logits in _solo(model, p, 5)] for p in prompts]
        stock, stock_passes = _generate_all(BatchGenerator, model, prompts, 6, step, late)
        flash, passes = _generate_all(FlashBatchGenerator, model, prompts, 6, step, late)
    finally:
        model.flash.close()
    assert flash == solo and stock == solo
    if not model.forward.sequences_alone:
        assert passes == stock_passes
        return
    # within the pass's positions (a chunk cut as a request alone cuts it may come beside the 4 decoding sequences)
    assert all(sum(lengths) <= step + (0 if model.forward.rows_alone else 4) for lengths in passes)
    assert len(passes) < 0.75 * len(stock_passes), (len(passes), len(stock_passes))


# -- the server ---------------------------------------------------------------------------------------------------

TOPICS = ["cats", "the sea", "rockets", "bread", "music", "rivers", "trains", "chess"]


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


def chat(port, i, max_tokens=24, **extra):
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
    solo = [chat(port, i) for i in range(4)]
    assert metrics(port)["largest_batch"] == 1
    m0 = metrics(port)
    assert together(lambda i: chat(port, i), 4) == solo  # text, logprobs and finish reasons
    m = metrics(port)
    assert m["largest_batch"] >= 2 and m["in_flight"] == 0 and m["baseline_rss"] > 0
    assert m["generated_tokens"] - m0["generated_tokens"] == sum(len(s[1]) for s in solo)


def test_stop_sequences_and_logprobs_per_request(server):
    _, _, port = server
    asks = [dict(stop=["the"]), dict(top_logprobs=3), dict(stop=[".", ","], max_tokens=40), dict(temperature=0.0)]
    solo = [chat(port, i, **a) for i, a in enumerate(asks)]
    assert together(lambda i: chat(port, i, **asks[i]), 4) == solo
    plain = chat(port, 2, max_tokens=40)
    assert plain[2] == "length" and solo[2][2] == "stop" and len(solo[2][1]) < len(plain[1])  # the stop acted
    assert len(solo[1][1]) == 24 and solo[1][0] == chat(port, 1)[0]


def test_a_long_prompt_joins_a_running_batch(server):
    """A prompt of several prefill chunks sent while others decode: all equal their solo runs."""
    provider, _, port = server
    long = {"messages": [{"role": "user", "content": "Summarise: " + "the cat sat on the mat and " * 20}]}
    long_ask = lambda: chat(port, 0, messages=long["messages"])  # noqa: E731
    assert provider.cli_args.prefill_step_size < 150  # (more than one chunk)
    solo = [chat(port, i, max_tokens=48) for i in range(3)] + [long_ask()]

    def run(i):
        if i < 3:
            return chat(port, i, max_tokens=48)
        time.sleep(0.5)  # the others are decoding
        return long_ask()

    assert together(run, 4) == solo


def test_prompt_lookup_and_plain_requests_mixed(server):
    """Prompt lookup (lossless, served alone) and plain requests at once: each gives the plain request's tokens."""
    _, _, port = server
    plain = [chat(port, i) for i in range(4)]
    got = together(lambda i: chat(port, i, prompt_lookup=i % 2 == 0), 4)
    assert [g[0] for g in got] == [p[0] for p in plain]
    status, _, payload = post(port, {"messages": [{"role": "user", "content": "x"}], "prompt_lookup": "yes"})
    assert status == 400 and b"prompt_lookup" in payload


def test_a_client_leaving_mid_batch_frees_its_slot(server):
    provider, _, port = server
    solo = chat(port, 1, max_tokens=64)
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
        return chat(port, 1, max_tokens=64)

    _, other = together(run, 2)
    assert other == solo  # the one that stayed is undisturbed
    deadline = time.time() + 30
    while metrics(port)["in_flight"] and time.time() < deadline:
        time.sleep(0.2)
    assert metrics(port)["in_flight"] == 0


def test_admission_and_a_full_queue(smol):
    """--max-batch 2: five requests all answered, never more than two decoded together; --max-queue 0 with the batch
    full: a 503 with Retry-After, and the server goes on."""
    provider, generator, httpd = _serve(smol, "--max-batch", "2", "--max-queue", "0", "--prompt-cache-size", "0")
    port = httpd.server_address[1]
    try:
        fd = provider.model.flash.fd
        assert provider.model.flash.plan.kv_cache == 2 * kv_cache_bytes(fd.config, CONTEXT, kv_size_of(fd))
        first = threading.Thread(target=lambda: chat(port, 0, max_tokens=120))
        second = threading.Thread(target=lambda: chat(port, 1, max_tokens=120))
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
        assert all(r[0] for r in together(lambda i: chat(port, i, max_tokens=8), 5))
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
