"""mlx_flash.peers: the summary / table / ratio logic on canned runs, the synthetic GGUF writer, and
(where llama.cpp is already built: the tests never build it) one real llama.cpp run."""

from pathlib import Path

from mlx_flash import peers
from mlx_flash.convert import convert
from mlx_flash.format.directory import FlashDir
from mlx_flash.tools import peers_systems
from mlx_flash.tools.synthetic_gguf import write_gguf

import gguf
import pytest

MiB = 1 << 20


def _run(system, pct, tok_s, tokens=9, read=100 * MiB, oom=False, rnd=0):
    return {
        "system": system,
        "budget_pct": pct,
        "tokens": tokens,
        "generated": tokens if tok_s else None,
        "tok_s": tok_s,
        "oom": oom,
        "returncode": -9 if oom else 0,
        "read_bytes": read,
        "max_rss": 50 * MiB,
        "cgroup_peak": 60 * MiB,
        "round": rnd,
    }


def canned():
    runs = []
    for rnd, (a, b) in enumerate([(1.0, 2.0), (3.0, 2.5), (2.0, 9.0)]):
        runs += [
            _run("llama.cpp mmap", 50, a, read=10 * MiB + 8 * 4 * MiB, rnd=rnd),
            _run("mlx_flash dense", 50, b, read=20 * MiB + 8 * 2 * MiB, rnd=rnd),
            _run("llama.cpp", 50, None, oom=True, rnd=rnd),
        ]
    runs += [
        _run("llama.cpp mmap", 50, 5.0, tokens=1, read=10 * MiB),
        _run("mlx_flash dense", 50, 5.0, tokens=1, read=20 * MiB),
        _run("llama.cpp", 50, None, tokens=1, oom=True),
    ]
    return {
        "model": "canned",
        "budgets": [50],
        "weight_bytes": 1000 * MiB,
        "baseline_rss": 100 * MiB,
        "summary": peers.summarize(runs),
    }


def test_summary_medians_bytes_per_token_and_oom():
    s = canned()["summary"]
    assert s["llama.cpp mmap"]["50%"]["tok_s"] == 2.0
    assert s["mlx_flash dense"]["50%"]["tok_s"] == 2.5
    assert s["llama.cpp mmap"]["50%"]["bytes_per_token"] == 4 * MiB  # (N-token run - 1-token run) / (N - 1)
    assert s["mlx_flash dense"]["50%"]["bytes_per_token"] == 2 * MiB
    assert s["llama.cpp"]["50%"]["tok_s"] is None and s["llama.cpp"]["50%"]["oom"] == 3


def test_ratios_and_table():
    res = canned()
    r = peers.ratios(res["summary"], [50])["50%"]
    assert r["dense"] == pytest.approx(1.25) and r["best_system"] == "mlx_flash dense"
    t = peers.table(res)
    assert "OOM-killed 3/3" in t and "1.25x" in t and "cap 600.0 MiB" in t


def test_header_brackets_the_run_with_fio():
    res = dict(
        canned(),
        tokens=9,
        rounds=3,
        flash_bytes=1000 * MiB,
        versions={"mlx": "0"},
        machine={"python": "3", "cores": 2},
        fio={"block": MiB, "threads": 32, "bytes_per_s": 2 * 2**30},
    )
    assert "2.0 GiB/s" in peers.header(res) and "at the end" not in peers.header(res)
    res["fio_end"] = dict(res["fio"], bytes_per_s=1.5 * 2**30)
    assert "2.0 GiB/s at the start, 1.5 GiB/s at the end" in peers.header(res)


def test_parse_steps():
    steps = (
        'Generation: 9 tokens, 3.2 tokens-per-sec\nsteps: {"prompt_tokens": 1, "steps": 8, "tok_s": 3.0, '
        '"step_ms_mean": 333.3, "step_ms_median": 320.0, "hit_rate": 0.5}\n'
    )
    assert peers_systems.parse_steps("mlx-lm", steps) == {
        "generated": 8,
        "prompt_tokens": 1,
        "tok_s": 3.0,
        "step_ms_mean": 333.3,
        "step_ms_median": 320.0,
        "hit_rate": 0.5,
    }
    llama = '[\n  {"n_prompt": 0, "n_gen": 8, "avg_ts": 3.5, "n_threads": 2}\n]\n'
    got = peers_systems.parse_steps("llama.cpp mmap", llama)
    assert got["generated"] == 8 and got["tok_s"] == 3.5 and got["step_ms_median"] is None
    assert (
        peers_systems.parse_steps("llama.cpp", "killed") == {}
        and peers_systems.parse_steps("mlx_flash dense", "Killed") == {}
    )


def test_steps_time_decode_steps_only():
    """The Python systems' tokens/s: decode steps over their time, from the first token's arrival (the prompt's
    pass makes it) to the last's; 9 tokens are 8 steps."""
    from mlx_flash.tools import steps

    arrivals = [5.0] + [5.0 + 2 * i for i in range(1, 8)] + [5.0 + 14 + 4]  # 7 steps of 2 s, then one of 4 s
    s = steps.summary(arrivals, {"prompt_tokens": 1})
    assert s["steps"] == 8 and s["tok_s"] == pytest.approx(8 / 18.0)
    assert s["step_ms_mean"] == pytest.approx(18e3 / 8) and s["step_ms_median"] == pytest.approx(2e3)
    assert steps.summary(arrivals, {"speculative": True})["step_ms_median"] is None
    assert steps.summary([1.0], {})["tok_s"] is None


def test_every_system_gets_one_prompt_token_and_the_same_steps():
    paths = {k: Path(k) for k in ("gguf", "flash", "flash_dip", "mlx", "nunspark")}
    paths.update(prompt="W", prompt_id=87)
    for system, (builder, _) in peers_systems.SYSTEMS.items():
        cmd = [str(c) for c in builder(paths, 8, 1000)]
        if system.startswith("llama.cpp"):
            assert cmd[cmd.index("-n") + 1] == "8" and cmd[cmd.index("-p") + 1] == "0"
            continue
        # the prompt's token + 8
        assert cmd[1] == str(peers_systems.STEPS) and cmd[cmd.index("--max-tokens") + 1] == "9"
        assert ("--prompt-ids", "87") in zip(cmd, cmd[1:]) or ("--prompt", "W") in zip(cmd, cmd[1:])


def test_plot(tmp_path):
    res = canned()
    peers.plot(res, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_gguf("tiny", tmp_path_factory.mktemp("gguf") / "tiny.gguf", progress=False, vocab_size=320)


def test_synthetic_gguf_is_read_and_converted(tiny_gguf, tmp_path):
    r = gguf.GGUFReader(str(tiny_gguf))
    shapes = {t.name: (t.tensor_type.name, [int(x) for x in t.shape]) for t in r.tensors}
    assert shapes["blk.0.ffn_down.weight"] == ("Q4_0", [512, 128])  # ne: [n_ff, d]
    assert shapes["token_embd.weight"] == ("Q4_0", [128, 320])
    fd = FlashDir(convert(str(tiny_gguf), tmp_path / "flash", progress=False))
    assert fd.config["intermediate_size"] == 512 and len(fd.layers) == 4


def _built(name):
    exe = peers_systems.llama_cpp_path(name)
    return exe if exe.is_file() else None


@pytest.mark.skipif(
    _built("llama-bench") is None, reason="llama.cpp is not built (python -m mlx_flash.peers builds it)"
)
def test_llama_cpp_runs_the_tiny_gguf(tiny_gguf):
    rec = peers_systems.run_one("llama.cpp mmap", {"gguf": tiny_gguf}, 8, None, "1GiB", [tiny_gguf], timeout=120)
    assert rec["returncode"] == 0 and not rec["oom"], rec.get("error")
    assert rec["generated"] == 8 and rec["tok_s"] > 0 and rec["max_rss"] > 0


def test_merge_runs_of_separate_budgets():
    a, b = canned(), canned()
    a["runs"] = [_run("llama.cpp mmap", 50, 2.0), _run("llama.cpp mmap", 50, 5.0, tokens=1)]
    b["runs"] = [_run("llama.cpp mmap", 25, 1.0), _run("llama.cpp mmap", 25, 5.0, tokens=1)]
    b["budgets"] = [25]
    a["rounds"] = b["rounds"] = 1
    m = peers.merge([a, b])
    assert m["budgets"] == [25, 50]
    assert (
        m["summary"]["llama.cpp mmap"]["25%"]["tok_s"] == 1.0 and m["summary"]["llama.cpp mmap"]["50%"]["tok_s"] == 2.0
    )


def test_parse_flash_stats_reads_the_generate_summary():
    from mlx_flash.tools.peers_systems import parse_flash_stats

    line = (
        "summary over 10 tokens (medians): io 810.57 ms, mm 13.33 ms, compute 1918.61 ms, total 2725.61 ms "
        "(0.37 tok/s); read 2.3 GiB/token at the device (2.3 GiB asked) at 912.5 MiB/s while reads were in "
        "flight, hit rate 1.8%, active units/layer 11008.0"
    )
    got = parse_flash_stats("noise\n" + line + "\nmore")
    assert got["io_share"] == pytest.approx(810.57 / 2725.61)
    assert got["read_bytes_per_s"] == pytest.approx(912.5 * 2**20)
    assert parse_flash_stats(line.replace(" at 912.5 MiB/s while reads were in flight", ""))["read_bytes_per_s"] is None
    assert parse_flash_stats("no summary") == {}


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="VmHWM is Linux's")
def test_baseline_is_the_childs_own_peak(tiny_gguf, tmp_path):
    """A child's wait4 ru_maxrss can be its parent's RSS at fork (Linux keeps the larger across exec): after
    a parent grew by 1 GiB (as peers does converting a 7B), the baseline is still the child's own."""
    flash = convert(str(tiny_gguf), tmp_path / "flash", progress=False)
    big = bytearray(1 << 30)
    big[::4096] = b"x" * len(big[::4096])  # touch it: resident
    assert peers_systems.measure_baseline(flash) < 512 * 2**20


def test_budgets_as_a_share_of_the_weights_or_as_one_absolute_cap():
    assert peers.budget_and_cap(50, 1000 * MiB, 100 * MiB) == (500 * MiB, 600 * MiB)
    assert peers.budget_and_cap("2GiB", 1000 * MiB, 100 * MiB) == (2048 * MiB - 100 * MiB, 2048 * MiB)
    with pytest.raises(ValueError, match="below the Python baseline"):
        peers.budget_and_cap("64MiB", 1000 * MiB, 100 * MiB)
    res = canned()
    res["budgets"] = ["1GiB"]
    res["summary"] = peers.summarize(
        [
            dict(r, budget_pct="1GiB")
            for r in [
                _run("llama.cpp mmap", 0, 2.0),
                _run("llama.cpp mmap", 0, 5.0, tokens=1),
                _run("mlx_flash dense", 0, 3.0),
                _run("nunspark", 0, 0.5),
            ]
        ]
    )
    t = peers.table(res)
    assert "| cap 1GiB |" in t.splitlines()[0] and "1.50x" in t and "| mlx_flash dense / nunspark | 6.00x |" in t


def test_parse_nunspark_hits():
    out = (
        "--- metrics ---\ncache hits / misses   : 30 / 10\n"
        'steps: {"prompt_tokens": 1, "steps": 4, "tok_s": 0.5, "step_ms_mean": 2000, "step_ms_median": 1900}\n'
    )
    got = peers_systems.parse_steps("nunspark", out)
    assert got["generated"] == 4 and got["tok_s"] == 0.5 and got["hit_rate"] == 0.75


def test_nunspark_budget_backs_off_until_it_holds_the_cap(monkeypatch):
    """nunspark's --budget does not bound its process: it is lowered by NUNSPARK_BACKOFF until the run holds
    the cap, the killed attempts are kept under their own label, and later rounds start at what held."""
    told = []

    def fake(system, paths, tokens, budget, cap, files, timeout=None, resident=False):
        told.append(budget)
        return _run(system, None, None if budget > 500 * MiB else 1.0, oom=budget > 500 * MiB)

    monkeypatch.setattr(peers, "run_one", fake)
    runs, tried = [], {}
    rec = peers._nunspark_run({}, 8, 1000 * MiB, 1100 * MiB, [], None, tried, 50, runs)
    assert not rec["oom"] and rec["system_budget"] == told[-1] <= 500 * MiB
    assert told == [
        int(1000 * MiB * peers.NUNSPARK_SHARE),
        int(int(1000 * MiB * peers.NUNSPARK_SHARE) * peers.NUNSPARK_BACKOFF),
    ]
    assert [r["system"] for r in runs] == ["nunspark (OOM-killed at its budget)"]
    told.clear()
    peers._nunspark_run({}, 8, 1000 * MiB, 1100 * MiB, [], None, tried, 50, runs)
    assert len(told) == 1 and told[0] <= 500 * MiB


def test_steps_times_mlx_flash_and_mlx_lm_alike(tiny_gguf, tmp_path):
    """The harness's Python systems on the tiny model: one prompt token, then the same 4 decode steps each."""
    import subprocess

    from mlx_flash.convert.export import export

    flash = convert(str(tiny_gguf), tmp_path / "flash", progress=False)
    mlx = export(flash, tmp_path / "mlx", progress=False)
    text, first = peers_systems.one_token_prompt(flash)
    assert text == "W" and first == ord("W")  # the byte-level tokenizer: "Write ..." starts with one byte
    paths = {"flash": flash, "mlx": mlx, "prompt": text}
    for system in ("mlx_flash dense", "mlx-lm"):
        cmd = [str(c) for c in peers_systems.SYSTEMS[system][0](paths, 4, "1GiB")]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        got = peers_systems.parse_steps(system, out.stdout)
        assert out.returncode == 0 and got["prompt_tokens"] == 1 and got["generated"] == 4, out.stderr[-2000:]
        assert got["tok_s"] > 0 and got["step_ms_median"] > 0
        if system.startswith("mlx_flash"):
            assert got["hit_rate"] is not None and got["cache_units"] >= 0


def test_resident_baselines_come_from_the_runs():
    """The resident rows (no cap, model in the page cache) are the JSON's baselines and a ratio row: none typed."""
    runs = [
        _run("llama.cpp", None, 4.0),
        _run("llama.cpp", None, 5.0, tokens=1),
        _run("llama.cpp mmap", 50, 1.0),
        _run("llama.cpp mmap", 50, 5.0, tokens=1),
        _run("mlx_flash dense", 50, 2.0),
        _run("mlx_flash dense", 50, 5.0, tokens=1),
    ]
    res = dict(canned(), summary=peers.summarize(runs))
    assert peers.resident_baselines(res["summary"]) == {"llama.cpp": res["summary"]["llama.cpp"]["resident"]}
    assert res["summary"]["llama.cpp"]["resident"]["tok_s"] == 4.0
    t = peers.table(res)
    assert "| resident |" in t.splitlines()[0] and "| mlx_flash dense / llama.cpp resident | 0.50x |" in t
