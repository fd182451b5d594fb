"""Pipeline stages (mlx_flash/pipeline.py, models/stage.py): each rank loads, plans and streams its own layers; the
tokens are the single process's, bit for bit; bad input and a lost rank end every rank with one line."""

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time

from mlx_flash.budget import fixed_bytes, min_budget, with_streamed
from mlx_flash.convert.build import convert
from mlx_flash.default_model import default_model_dir
from mlx_flash.engine.resident import stream_groups
from mlx_flash.errors import CapError
from mlx_flash.format.directory import FlashDir
from mlx_flash.io import memory
from mlx_flash.loader import cpu_cast, kv_size_of, load, load_tokenizer
from mlx_flash.models.inspect import instantiate
from mlx_flash.models.stage import StageDir
from mlx_flash.pipeline import PipelineError, parse_split, split_layers
from mlx_flash.tools.cap import run_capped
from mlx_flash.tools.ranks import free_ports, rank_env, run_ranks, write_hostfile
from mlx_flash.tools.synthetic import tiny_quantized

import mlx.core as mx
import numpy as np
import pytest

CONTEXT = 64
PROMPT = [1, 5, 9, 33, 70, 2, 11]


@pytest.fixture(scope="module")
def smollm2():
    return default_model_dir()


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    """A 4-layer qwen3_moe, 4-bit, converted (three stages need three layers at least)."""
    root = tmp_path_factory.mktemp("pipeline-moe")
    return convert(str(tiny_quantized("qwen3_moe", root, num_hidden_layers=4)), root / "flash", progress=False)


def matching_budget(whole, stage, context=CONTEXT) -> int:
    """A stage's budget that gives its layers the unit caches (and read-ahead buffers) the whole model's plan gives
    them: its own floor (its resident weights resident but an input embedding, which the planner streams by rows
    whenever a unit would not be cached: a tied one on the first stage) plus those bytes. Device bytes compare."""
    plan, fd = whole.flash.plan, whole.flash.fd
    strides = {k: v.stride for k, v in fd.layouts.items()}
    caches = sum(
        c * strides[r] for layer in plan.capacity[stage.start : stage.stop] for r, c in layer.items()
    ) + 2 * plan.prefetch_rows * strides.get("neurons", 0)
    rows = [
        g
        for g in stream_groups(stage, instantiate(stage.config), cpu_cast, context)
        if g.kind == "rows" and g.nbytes > 2 * g.load_bytes
    ]
    fixed = fixed_bytes(stage, context, kv_size_of(stage), resident=stage.resident_nbytes(cpu_cast))
    return sum(with_streamed(fixed, rows).values()) + caches


def decode_chained(stages, n):
    """Greedy tokens and every step's logits of the stages run in order in this process (embed on the first, the
    float32 rows passed on, the head on the last)."""
    caches = [m.make_cache() for m in stages]
    tokens, out, logits = list(PROMPT), [], []
    for _ in range(n):
        prompt = len(tokens) > 1
        x = tokens
        for model, cache in zip(stages, caches):
            x = model.forward.stage(x, cache, prompt)
        step = x
        logits.append(np.array(step))
        tokens = [int(mx.argmax(step[0, -1]).item())]
        out.append(tokens[0])
    return out, logits


@pytest.mark.parametrize("name, ranks, cached", [("smollm2", 2, 0.5), ("smollm2", 3, 0.25), ("tiny_moe", 3, 0.25)])
def test_stages_give_the_whole_models_bits_and_bytes(request, name, ranks, cached):
    """Stages chained in one process: the whole model's logits bit for bit, each stage holding and reading only its
    layers (its resident bytes below the whole's, device bytes summing to the whole's within 5%)."""
    path = request.getfixturevalue(name)
    fd = FlashDir(path)
    # every resident weight resident (so the stages' plans stream none either), `cached` of the FFN units cached
    budget = min_budget(fd, CONTEXT, kv_size_of(fd), resident=fd.resident_nbytes(cpu_cast)) + int(cached * fd.ffn_bytes)
    # (experts read ahead: a stage guesses no further than its own last layer, so its wasted reads differ)
    ahead = {"prefetch": False} if fd.ffn.get("kind") == "moe" else {}
    whole, _ = load(path, memory_budget=budget, context=CONTEXT, **ahead)
    bounds = split_layers(fd, ranks)[::-1]  # the first stage (the last rank) first
    assert [b[0] for b in bounds] == [0] + [b[1] for b in bounds[:-1]] and bounds[-1][1] == len(fd.layers)
    stages = []
    for start, stop in bounds:
        budget_s = matching_budget(whole, StageDir(fd, start, stop))
        model, _ = load(path, memory_budget=budget_s, context=CONTEXT, layers=(start, stop), **ahead)
        assert len(model.layers) == stop - start
        assert model.flash.plan.resident < whole.flash.plan.resident
        stages.append(model)
    n = 8
    want, want_logits = [], []
    cache, tokens = whole.make_cache(), list(PROMPT)
    for _ in range(n):
        step = whole.forward(tokens, cache, prompt=len(tokens) > 1)
        want_logits.append(np.array(step))
        tokens = [int(mx.argmax(step[0, -1]).item())]
        want.append(tokens[0])
    got, got_logits = decode_chained(stages, n)
    assert got == want
    assert all(np.array_equal(a, b) for a, b in zip(want_logits, got_logits))
    single = whole.flash.stats.device_bytes()
    per_stage = [m.flash.stats.device_bytes() for m in stages]
    assert single > 0 and all(b > 0 for b in per_stage), (single, per_stage)  # every stage streams
    assert abs(sum(per_stage) - single) <= 0.05 * single, (single, per_stage)
    for m in [whole, *stages]:
        m.flash.close()


def test_split_by_bytes_and_by_hand(smollm2):
    fd = FlashDir(smollm2)
    assert split_layers(fd, 2) == [(15, 30), (0, 15)]  # rank 0 the last layers, as mlx-lm's
    assert split_layers(fd, 2, parse_split("10,20", 2, 30)) == [(20, 30), (0, 20)]
    for bad in ("10,10", "30,0", "1,2,27", "a,b"):
        with pytest.raises(PipelineError, match="--pipeline-split"):
            parse_split(bad, 2, 30)
    with pytest.raises(PipelineError, match="at least one layer"):
        split_layers(fd, 31)


# -- ranks in processes, as mlx.launch runs them -----------------------------------------------------------------


def generate_cmd(path, *args):
    return [sys.executable, "-m", "mlx_flash.generate", "--model", str(path), "--max-tokens", "8", *args]


def single_text(path, *args) -> str:
    r = run_capped(generate_cmd(path, *args), timeout=300)  # (as the ranks' output: no newline translation)
    assert r.returncode == 0, r.stderr
    return r.stdout.split("\n==========")[0]


def test_two_ranks_under_hard_caps(smollm2):
    """SmolLM2 over 2 ranks, each under a cap of its budget + the baseline: rank 0 prints the single process's text;
    --stats names each rank's layers and the bytes it reads."""
    budget = 40 << 20
    args = ("--memory-budget", str(budget), "--stats", "--prompt", "Name three colours.")
    base = run_capped(memory.baseline_command(smollm2))
    assert base.ok, base.stderr
    try:
        results = run_ranks(2, generate_cmd(smollm2, *args), limit=budget + base.max_rss, timeout=240)
    except CapError as e:
        pytest.skip(f"no hard memory cap on this machine: {e}")
    assert [r.returncode for r in results] == [0, 0], [r.stderr[-2000:] for r in results]
    assert not any(r.oom_killed for r in results)
    assert results[0].stdout.split("\n==========")[0] == single_text(smollm2, *args)
    assert results[1].stdout == ""  # rank 0 prints
    stages = re.findall(
        r"rank (\d): layers (\d+)-(\d+), budget 40.0 MiB: read ([\d.]+) (KiB|MiB)/token", results[0].stdout
    )
    assert [s[:3] for s in stages] == [("0", "15", "29"), ("1", "0", "14")], results[0].stdout
    assert all(float(s[3]) > 0 for s in stages)  # each rank streams its own layers


def test_stats_gather_every_ranks_figures(smollm2):
    """--stats on rank 0: one line per rank (its layers, bytes read, hit rate, I/O and compute per token), and the
    ranks' device bytes sum to the single process's (here in this process, at the same context and prompt) within
    5%, each rank at the budget that gives its layers the whole model's unit caches; the text is the single's."""
    from mlx_flash.generate import generate

    prompt, n = "The colour of the sky is", 8
    fd = FlashDir(smollm2)
    tokens = load_tokenizer(fd).encode(prompt)
    context = len(tokens) + n  # rank 0's plan for the prompt, which every rank then plans for
    budget = min_budget(fd, context, kv_size_of(fd), resident=fd.resident_nbytes(cpu_cast)) + int(0.5 * fd.ffn_bytes)
    whole, tokenizer = load(smollm2, memory_budget=budget, context=context)
    want = generate(whole, tokenizer, tokens, max_tokens=n)
    single = whole.flash.stats.device_bytes()
    budgets = [matching_budget(whole, StageDir(fd, *b), context) for b in split_layers(fd, 2)]
    whole.flash.close()
    args = ("--stats", "--prompt", prompt, "--ignore-chat-template")
    results = run_ranks(2, [generate_cmd(smollm2, "--memory-budget", str(b), *args) for b in budgets], timeout=240)
    assert [r.returncode for r in results] == [0, 0], [r.stderr[-2000:] for r in results]
    out = results[0].stdout
    assert out.split("\n==========")[0] == want
    lines = re.findall(r"rank (\d): layers .* hit rate ([\d.]+)%, io ([\d.]+) ms, compute ([\d.]+) ms", out)
    assert [line[0] for line in lines] == ["0", "1"], out
    rows = json.loads(re.search(r"pipeline stages \(JSON\): (.*)", out).group(1))
    per_rank = [r["device_bytes"] for r in rows]
    assert single > 0 and all(b > 0 for b in per_rank), (single, per_rank)
    assert abs(sum(per_rank) - single) <= 0.05 * single, (single, per_rank)


@pytest.mark.parametrize(
    "budget, speculative", [("170KiB", ()), ("170KiB", ("--prompt-lookup",)), ("1MiB", ("--draft-model", "SELF"))]
)
def test_three_ranks_moe_by_hand(tiny_moe, budget, speculative):
    """The tiny MoE over 3 ranks split by hand, each reading experts under a budget below one layer's 8: the text of
    the whole model in memory (the same at every budget), plain and with speculative passes (drafts verified over the
    stages, rejected ones trimmed on every rank; a draft model on rank 0 only, inside its budget)."""
    speculative = tuple(str(tiny_moe) if a == "SELF" else a for a in speculative)
    prompt = ("--prompt", "hello hello hello hello hello", "--ignore-chat-template")
    args = ("--memory-budget", budget, "--pipeline-split", "1,1,2", "--stats", *prompt, *speculative)
    results = run_ranks(3, generate_cmd(tiny_moe, *args), timeout=240)
    assert [r.returncode for r in results] == [0, 0, 0], [r.stderr[-2000:] for r in results]
    assert results[0].stdout.split("\n==========")[0] == single_text(tiny_moe, *prompt)
    device = re.findall(r"rank (\d): layers (\d)-(\d), .*\(([\d.]+) KiB in all\)", results[0].stdout)
    assert [d[:3] for d in device] == [("0", "3", "3"), ("1", "2", "2"), ("2", "0", "1")], results[0].stdout
    assert all(float(d[3]) > 0 for d in device)
    if speculative:
        drafted = re.search(r"speculative: \d+ passes, (\d+) drafted", results[0].stdout)
        assert drafted and int(drafted.group(1)) > 0, results[0].stdout


@pytest.mark.parametrize("command", ["generate", "server"])
def test_bad_split_is_one_line_on_every_rank(tiny_moe, command):
    cmd = [sys.executable, "-m", f"mlx_flash.{command}", "--model", str(tiny_moe), "--pipeline-split", "2,3"]
    results = run_ranks(2, cmd, timeout=120)
    for r in results:
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.strip().splitlines() == [
            "error: --pipeline-split 2,3: needs 2 positive counts (one per rank) summing to the model's 4 layers"
        ]


def start_ranks(path, n, env=None):
    hostfile = write_hostfile(n)
    cmd = generate_cmd(path, "--memory-budget", "50%", "--prompt", "Tell me a long story.")
    cmd[cmd.index("8")] = "400"
    return [
        subprocess.Popen(
            cmd,
            env=rank_env(r, hostfile, dict(os.environ, **(env or {}))),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(n)
    ]


def last_line(err: str) -> str:
    """The last line a rank printed, MLX's ring backend's own reports aside (its threads may print them after)."""
    return [line for line in err.strip().splitlines() if not line.startswith("[ring]")][-1]


@pytest.mark.parametrize("how, victim", [("killed", 1), ("stopped", 1), ("killed", 0)])
def test_a_lost_rank_ends_the_others(smollm2, how, victim):
    """A rank killed (its sockets close) or stopped (silent: the watchdog's timeout, here 10 s) mid-generation: rank 0
    exits with status 1 and one line within the timeout (30 s by default), not a hang."""
    # (a timeout a pass keeps even on a loaded machine, where the ranks' spinning waits slow the one computing)
    procs = start_ranks(smollm2, 2, {"MLX_FLASH_PIPELINE_TIMEOUT": "10"})
    try:
        os.set_blocking(procs[0].stdout.fileno(), False)
        deadline = time.monotonic() + 240  # (loading two ranks on a loaded machine)
        while not procs[0].stdout.read(1):  # generating
            assert procs[0].poll() is None and time.monotonic() < deadline, procs[0].stderr.read()
            time.sleep(0.2)
        procs[victim].send_signal(signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        start = time.monotonic()
        rc = procs[1 - victim].wait(timeout=30)
        assert time.monotonic() - start < 30
        err = procs[1 - victim].stderr.read()
        assert rc == 1 and "Traceback" not in err, err
        line = last_line(err)
        assert line.startswith(f"error: pipeline rank {1 - victim}:"), err
        # a closed socket fails the exchange at once, or (the ring's all_sum) leaves it to the watchdog: 10 s a
        # decode step's, 20 s where the victim stopped right after the prompt's pass (its rows take longer)
        timed_out = re.search(r"no answer within (10|20) s", line)
        assert timed_out or (how == "killed" and "another rank ended" in line), line
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_under_mlx_launch(tiny_moe):
    """`mlx.launch --backend ring -n 2` itself (it prints the ranks' output, rank 0's text among it)."""
    launcher = os.path.join(os.path.dirname(sys.executable), "mlx.launch")
    if not os.path.exists(launcher):
        pytest.skip("no mlx.launch beside this interpreter")
    prompt = ("--prompt", "hello", "--ignore-chat-template")
    cmd = [
        launcher,
        "--backend",
        "ring",
        "-n",
        "2",
        "--",
        *generate_cmd(tiny_moe, "--memory-budget", "200KiB", *prompt),
    ]
    r = run_capped(cmd, timeout=240)
    assert r.returncode == 0 and "error" not in r.stderr, r.stderr
    text = single_text(tiny_moe, *prompt)
    assert text and text in r.stdout


# -- the server over stages ---------------------------------------------------------------------------------------


def start_server_ranks(path, n, tmp_path, *args, timeout="10"):
    """The server under a ring launch of n ranks (the watchdog's timeout short); the processes, the port and each
    rank's stderr file, once rank 0 serves."""
    port = free_ports(1)[0]
    cmd = [sys.executable, "-m", "mlx_flash.server", "--model", str(path), "--port", str(port), "--max-context", "256"]
    hostfile = write_hostfile(n)
    env = dict(os.environ, MLX_FLASH_PIPELINE_TIMEOUT=timeout)
    errs = [tmp_path / f"rank{r}.err" for r in range(n)]
    procs = [
        subprocess.Popen(
            [*cmd, *args],  # (no budget: every unit cached once read, so that the passes are quick)
            env=rank_env(r, hostfile, env),
            stdout=subprocess.DEVNULL,
            stderr=errs[r].open("w"),
        )
        for r in range(n)
    ]
    deadline = time.monotonic() + 180
    while "serving" not in errs[0].read_text():
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            for p in procs:
                p.kill()
            pytest.fail("the ranks did not start serving: " + " | ".join(e.read_text()[-1000:] for e in errs))
        time.sleep(0.2)
    return procs, port, errs


def chat(port, content, **options):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0, **options}
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    payload = r.read()
    conn.close()
    assert r.status == 200, payload
    return json.loads(payload)["choices"][0]["message"]["content"]


def test_server_over_two_ranks(smollm2, tmp_path):
    """`python -m mlx_flash.server` as 2 ranks: rank 0 answers a chat request (temperature 0) with the single
    process's text, plain and with prompt lookup (its drafts verified over the stages: fewer decode passes), after
    idling longer than the watchdog's timeout (rank 0's pings keep the other rank following); stopped (SIGTERM), it
    stops the other rank, and both exit with status 0."""
    from mlx_flash.generate import generate

    prompt = "Repeat after me: one two three four five six seven eight nine ten"
    model, tokenizer = load(smollm2)  # the single process, here: greedy tokens are the same at every budget
    tokens = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    want = generate(model, tokenizer, tokens, max_tokens=8)
    model.flash.close()
    procs, port, errs = start_server_ranks(smollm2, 2, tmp_path, "--log-level", "INFO")
    try:
        time.sleep(12)  # idle past the 10 s timeout
        try:
            assert chat(port, prompt) == want
            assert chat(port, prompt, prompt_lookup=True) == want
        except (AssertionError, OSError) as e:
            raise AssertionError(f"{e}: " + " | ".join(f.read_text()[-2000:] for f in errs)) from e
        procs[0].send_signal(signal.SIGTERM)
        assert [p.wait(timeout=30) for p in procs] == [0, 0], [e.read_text()[-2000:] for e in errs]
        assert "error" not in errs[1].read_text()
        plain, lookup = (json.loads(r) for r in re.findall(r"flash reads: (.*)", errs[0].read_text()))
        assert len(lookup["decode_passes"]) < len(plain["decode_passes"]), (plain, lookup)
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_server_rank_0_killed_ends_the_others(smollm2, tmp_path):
    """Rank 0 of a serving pipeline killed while idle: the other rank ends within the watchdog's timeout (here 10 s;
    30 s by default) with status 1 and one line."""
    procs, _, errs = start_server_ranks(smollm2, 2, tmp_path)
    try:
        procs[0].kill()
        start = time.monotonic()
        rc = procs[1].wait(timeout=30)
        assert time.monotonic() - start < 30
        err = errs[1].read_text()
        assert rc == 1 and "Traceback" not in err, err
        assert last_line(err).startswith("error: pipeline rank 1:"), err
    finally:
        for p in procs:
            p.kill()
            p.wait()
