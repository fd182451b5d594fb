"""Prompt caches on disk (engine/prompt_store.py): a prompt starting with one already run reads its prefix instead of
prefilling it and gives a cold run's tokens and log-probabilities bit for bit; entries are bounded in bytes
(least recently used first); a truncated, corrupted or foreign file is refused, deleted and recomputed; a failed
write loses nothing."""

import http.client
import json
import os

from mlx_flash.budget import min_budget
from mlx_flash.convert import convert
from mlx_flash.engine.prompt_store import PromptStore, identity
from mlx_flash.format.directory import FlashDir
from mlx_flash.format.safetensors_io import TensorSpool
from mlx_flash.generate import generate_step
from mlx_flash.generate import main as generate_main
from mlx_flash.loader import kv_size_of, load
from mlx_flash.models.tiny import make_tiny_model_dir

import mlx.core as mx
import numpy as np
import pytest

CONTEXT = 256
STEP = 16  # prompt chunks: several a prompt, so a reused prefix must end where a cold run's chunk does
PROMPT = [int(t) for t in np.random.default_rng(0).integers(3, 250, 90)]  # (run once, then stored)
LONGER = PROMPT + [7, 100, 3, 9, 44, 12, 5, 61, 2, 18, 250, 40, 1, 9, 9, 31, 77, 120, 6, 11]  # 20 more


@pytest.fixture(scope="module")
def flash(tmp_path_factory):
    root = tmp_path_factory.mktemp("store")
    path = convert(str(make_tiny_model_dir("llama", root / "src", vocab_size=257)), root / "flash", progress=False)
    fd = FlashDir(path)
    model, _ = load(
        path, memory_budget=min_budget(fd, CONTEXT, kv_size_of(fd)) + fd.ffn_bytes // 3, sparsity="dense",
        context=CONTEXT,
    )  # fmt: skip
    yield path, model
    model.flash.close()


def run(model, prompt, n=6, store=None):
    steps = generate_step(mx.array(prompt), model, max_tokens=n, prefill_step_size=STEP, prompt_store=store)
    tokens, logprobs = zip(*steps)
    return list(tokens), np.stack([np.array(lp) for lp in logprobs])


def store_of(model, root, **kw):
    return PromptStore(root, identity(model), min_tokens=8, **kw)


def entries(store):
    return sorted(store.dir.glob("*.safetensors"))


def test_a_stored_prefix_gives_the_cold_run_bit_for_bit(flash, tmp_path):
    """The prompt run once, then with 20 more tokens in another store (a new process's view): the prefix is read
    (cut at a whole chunk where rows' rounding depends on the chunk) and tokens and log-probabilities equal those of
    a cold run of the longer prompt."""
    _, model = flash
    cold = run(model, LONGER)
    run(model, PROMPT, 3, store_of(model, tmp_path))
    assert len(entries(store_of(model, tmp_path))) == 1
    store = store_of(model, tmp_path)
    warm = run(model, LONGER, store=store)
    whole = len(PROMPT) + 2  # the prompt and the generated tokens fed (the last one is not)
    assert store.hits == 1
    assert store.tokens_read == (whole if model.forward.rows_alone else len(PROMPT) // STEP * STEP)
    assert warm[0] == cold[0]
    assert np.array_equal(warm[1], cold[1])


def test_the_prompt_already_stored_whole_computes_its_last_position(flash, tmp_path):
    _, model = flash
    cold = run(model, PROMPT)
    run(model, PROMPT, 1, store_of(model, tmp_path))
    store = store_of(model, tmp_path)
    again = run(model, PROMPT, store=store)
    assert 0 < store.tokens_read < len(PROMPT)
    assert again[0] == cold[0] and np.array_equal(again[1], cold[1])


@pytest.mark.parametrize("damage", ["truncated", "corrupted", "foreign", "not safetensors"])
def test_a_damaged_or_foreign_entry_is_refused_deleted_and_recomputed(flash, tmp_path, damage):
    _, model = flash
    cold = run(model, LONGER)
    run(model, PROMPT, 1, store_of(model, tmp_path))
    (path,) = entries(store_of(model, tmp_path))
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        data = data[: len(data) * 2 // 3]
    elif damage == "corrupted":
        data[-100] ^= 0x40  # a KV value's bits
    elif damage == "foreign":  # another model's entry under this one's name
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + n])
        header["__metadata__"]["identity"] = "0" * 24
        text = json.dumps(header).encode().ljust(n)
        data[8 : 8 + n] = text
    else:
        data = bytearray(b"not a safetensors file at all")
    path.write_bytes(bytes(data))
    store = store_of(model, tmp_path)
    warm = run(model, LONGER, store=store)
    assert store.refused == 1 and store.hits == 0 and store.tokens_read == 0
    assert warm[0] == cold[0] and np.array_equal(warm[1], cold[1])
    assert not path.exists() or path.read_bytes() != bytes(data)  # deleted (then the new prompt stored)


def test_the_directory_keeps_the_most_recently_used_entries_within_its_bound(flash, tmp_path):
    _, model = flash
    prompts = [[5 + i] * 40 for i in range(3)]
    run(model, prompts[0], 1, store_of(model, tmp_path))
    size = sum(p.stat().st_size for p in entries(store_of(model, tmp_path)))
    store = store_of(model, tmp_path, max_bytes=int(2.5 * size))
    run(model, prompts[1], 1, store)
    os.utime(entries(store)[0], ns=(0, 0))  # (whichever is first: made the oldest)
    oldest = entries(store)[0]
    run(model, prompts[2], 1, store)
    assert len(entries(store)) == 2 and oldest not in entries(store)
    assert store.nbytes() <= store.max_bytes


def test_a_prompt_extending_a_stored_one_replaces_it(flash, tmp_path):
    _, model = flash
    run(model, PROMPT, 1, store_of(model, tmp_path))
    run(model, LONGER, 1, store_of(model, tmp_path))
    (path,) = entries(store_of(model, tmp_path))
    assert len(json.loads(mx.load(str(path), return_metadata=True)[1]["tokens"])) == len(LONGER)


def test_a_failed_write_leaves_nothing_and_generation_goes_on(flash, tmp_path, monkeypatch):
    _, model = flash
    cold = run(model, PROMPT)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(TensorSpool, "add", full)  # (the disk fills as the entry's arrays are written)
    store = store_of(model, tmp_path)
    assert run(model, PROMPT, store=store)[0] == cold[0]
    assert list(store.dir.iterdir()) == []


def test_generate_reads_its_prompt_cache_dir(flash, tmp_path, capsys):
    """The command: a second run of a prompt (another process's view of the directory) reads it and prints the same
    text."""
    path, _ = flash
    argv = ["--model", str(path), "--prompt", "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 3,
            "--max-tokens", "5", "--memory-budget", "300%", "--sparsity", "dense", "--ignore-chat-template", "--stats",
            "--prompt-cache-dir", str(tmp_path)]  # fmt: skip
    outs = []
    for _ in range(2):
        assert generate_main(argv) == 0
        outs.append(capsys.readouterr().out)
    read = [int(o.split("prompt cache: ")[1].split()[0]) for o in outs]
    assert read[0] == 0 and read[1] > 0
    texts = [o.split("prompt cache: ")[0] for o in outs]
    assert texts[0] and texts[0] == texts[1]


def chat(port, content):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 6}
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = json.loads(conn.getresponse().read())
    conn.close()
    return r["choices"][0]["message"]["content"], r["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)


def test_a_restarted_server_resumes_a_prompt_from_the_directory(flash, tmp_path, start_server):
    """A server stores a prompt; another one started on the same directory (an empty memory tier: a restart) reads
    it for a prompt that starts the same way and answers as a server without the directory does."""
    path, _ = flash
    argv = ["--model", path, "--max-context", CONTEXT, "--memory-budget", "300%", "--sparsity", "dense",
            "--max-batch", "1"]  # fmt: skip
    doc = "the cat sat on the mat and then " * 6
    cold = chat(start_server(argv)[2], doc + "why?")
    assert cold[1] == 0
    chat(start_server(argv + ["--prompt-cache-dir", tmp_path])[2], doc)
    _, generator, port = start_server(argv + ["--prompt-cache-dir", tmp_path])
    warm = chat(port, doc + "why?")
    assert generator.prompt_cache.store.hits == 1
    assert warm[1] > 0 and warm[0] == cold[0]


def test_a_quantised_kv_cache_is_stored_and_read_bit_for_bit(tmp_path):
    """--kv-bits 8 (SmolLM2: a head dimension mx.quantize groups)."""
    from mlx_flash.default_model import default_model_dir

    model, _ = load(default_model_dir(), memory_budget="300%", context=CONTEXT, kv_bits=8)
    try:
        assert type(model.make_cache()[0]).__name__ == "QuantizedKVCache"
        cold = run(model, LONGER)
        run(model, PROMPT, 1, store_of(model, tmp_path))
        store = store_of(model, tmp_path)
        warm = run(model, LONGER, store=store)
        assert store.tokens_read > 0
        assert warm[0] == cold[0] and np.array_equal(warm[1], cold[1])
    finally:
        model.flash.close()
