"""The systems mlx_flash.peers compares, and one run of one of them under a hard memory cap.

llama.cpp is built from the sources vendored in llama-cpp-python's sdist (without AMX) into
~/.cache/mlx_flash/llama.cpp/<version>. The model directories are made once from one GGUF, under
~/.cache/mlx_flash/peers/<name>: its mlx_flash conversion (convert's defaults), that conversion exported for
mlx-lm, for SmolLM2 a calibrated DIP-layout conversion, and for nunspark its pack of the export.

SYSTEMS maps each system to the command it runs as (every Python system through tools/steps.py, which times
its decode steps) and the model path it reads; run_one runs one under a cap (mlx_flash.tools.cap) and reads
tokens/s, per-step times and cache hit rates from its output. How the systems are compared (budgets, caps,
baseline, rounds) is mlx_flash.peers'.
"""

import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Optional

from .. import __version__
from ..convert.build import convert
from ..convert.export import export
from ..default_model import CONVERSION, cache_root, default_gguf_path, default_model_dir
from ..format.directory import FlashDir
from ..io.memory import baseline_command
from ..loader import load_tokenizer
from .cap import run_capped
from .synthetic import PRESETS, ROUTINGS
from .synthetic_gguf import GGUF_ARCHS, MOE_TYPES, write_gguf

LLAMA_CPP_PYTHON = "0.3.36"  # PyPI llama-cpp-python sdist whose vendored llama.cpp is built
LLAMA_TARGETS = ("llama-bench", "llama-completion", "llama-perplexity", "llama-quantize")  # peers runs llama-bench
PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."  # its first token
STEPS = Path(__file__).parent / "steps.py"  # the Python systems' timing (a script: it imports no mlx_flash)
# MoE models: the Python systems sample at this temperature (near-uniform tokens), as llama-bench feeds a
# random token each step; a random-weight model's greedy text repeats one token, which would route every
# step alike and turn every expert read into a hit
MOE_TEMP = 10000.0


# The CPU's own instructions, but not AMX: a VM may report AMX without enabling its tile state, and then
# llama.cpp's first prompt matmul dies of SIGILL (seen on this project's machines). The flags name the build.
LLAMA_NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
LLAMA_BUILD = "build-noamx"


# -- llama.cpp, built from the sources vendored in llama-cpp-python's sdist ---------------------------
def llama_cpp_path(name: str) -> Path:
    """Where the llama.cpp program `name` is once built (it may not be)."""
    return cache_root() / "llama.cpp" / LLAMA_CPP_PYTHON / LLAMA_BUILD / "bin" / name


def llama_cpp_bin(name: str) -> Path:
    """Path of the llama.cpp program `name`, built once (several minutes) into
    ~/.cache/mlx_flash/llama.cpp/<version>."""
    root = cache_root() / "llama.cpp" / LLAMA_CPP_PYTHON
    exe = llama_cpp_path(name)
    if exe.is_file():
        return exe
    src = root / "src"
    if not (src / "CMakeLists.txt").is_file():
        print(
            f"[peers] downloading llama-cpp-python {LLAMA_CPP_PYTHON} (sdist) for its llama.cpp sources",
            file=sys.stderr,
        )
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "-q",
                    "--no-deps",
                    "--no-binary",
                    ":all:",
                    f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
                    "-d",
                    tmp,
                ],
                check=True,
            )
            with tarfile.open(next(Path(tmp).glob("*.tar.gz"))) as tar:
                tar.extractall(tmp, filter="data")
            vendored = next(Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp"))
            root.mkdir(parents=True, exist_ok=True)
            shutil.move(str(vendored), src)
    print(
        f"[peers] building llama.cpp ({', '.join(LLAMA_TARGETS)}) in {root}: several minutes, once; "
        f"log in {root / 'build.log'}",
        file=sys.stderr,
    )
    with open(root / "build.log", "w") as log:
        amx = (
            [f"-DCMAKE_C_FLAGS={LLAMA_NO_AMX}", f"-DCMAKE_CXX_FLAGS={LLAMA_NO_AMX}"]
            if platform.machine() == "x86_64"
            else []
        )
        subprocess.run(
            [
                "cmake",
                "-S",
                src,
                "-B",
                root / LLAMA_BUILD,
                "-DGGML_NATIVE=ON",
                "-DLLAMA_CURL=OFF",
                "-DCMAKE_BUILD_TYPE=Release",
                *amx,
            ],
            check=True,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        subprocess.run(
            ["cmake", "--build", root / LLAMA_BUILD, "-j2", "--target", *LLAMA_TARGETS],
            check=True,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    return exe


# -- the models: one GGUF, its flash directory, the flash directory exported for mlx-lm -----------------
# what a peers' flash directory was converted by: the default model's conversion, and (after the dash) a number bumped
# when convert's defaults change for the other models (2: an MoE GGUF's experts read in place, as its blocks;
# 3: resident K-quant matrices kept as their blocks)
PEERS_CONVERSION = f"{CONVERSION}-3"


def routing_of(model: str, routing: str = "uniform") -> Optional[str]:
    """The routing regime `model` runs with: `routing` for a synthetic MoE preset, None for the others."""
    if model in PRESETS and PRESETS[model]["model_type"] in MOE_TYPES:
        if routing not in ROUTINGS:
            raise ValueError(f"unknown routing {routing!r} (choose from {', '.join(ROUTINGS)})")
        return routing
    return None


def prepare(
    model: str, progress: bool = True, nunspark: bool = False, routing: str = "uniform", mlx: bool = True
) -> dict:
    """{"gguf", "flash", "mlx"[, "flash_dip", "nunspark"]} paths for `model` (small, a synthetic preset or a GGUF file;
    a synthetic MoE preset with `routing`), made once under ~/.cache/mlx_flash/peers/<name>[-<routing>]. mlx=False:
    the mlx-lm export (a copy of the model's size on disk) is made only if nunspark needs it."""

    synthetic = model in PRESETS and PRESETS[model]["model_type"] in GGUF_ARCHS
    regime = routing_of(model, routing)
    name = model if regime in (None, "own") else f"{model}-{regime}"
    if model == "small":
        gguf, flash = default_gguf_path(), default_model_dir()
    else:
        gguf = cache_root() / "peers" / name / "model.Q4_0.gguf" if synthetic else Path(model)
        if synthetic and not gguf.is_file():
            write_gguf(model, gguf, progress=progress, routing=regime or "own")
        flash = None
    root = cache_root() / "peers" / (name if model == "small" or synthetic else Path(model).stem)
    mlx_dir = root / "mlx"
    if flash is None:  # convert's defaults, as a user converts: the GGUF's own codes, units packed
        flash, made = root / "flash", root / "flash.conversion"  # made anew when convert's defaults change
        if not (flash / "flash.json").is_file() or not made.is_file() or made.read_text() != PEERS_CONVERSION:
            shutil.rmtree(flash, ignore_errors=True)
            convert(str(gguf), flash, progress=progress)
            made.write_text(PEERS_CONVERSION)
    paths = {"gguf": Path(gguf), "flash": Path(flash), "mlx": mlx_dir}
    if (mlx or nunspark) and not (paths["mlx"] / "config.json").is_file():
        shutil.rmtree(paths["mlx"], ignore_errors=True)
        export(flash, paths["mlx"], progress=progress)
    if model == "small":  # real weights: a calibrated DIP conversion is deployable
        dip = root / "flash-dip"
        if not (dip / "flash.json").is_file():
            shutil.rmtree(dip, ignore_errors=True)
            convert(str(gguf), dip, layout="dip", progress=progress)
        if "dip" not in (FlashDir(dip).manifest.get("sparsity") or {}):
            subprocess.run(
                [sys.executable, "-m", "mlx_flash.calibrate", "--model", dip, "--no-predictor", "--num-seqs", "2"],
                check=True,
            )  # DIP's ratio search uses --dip-seqs (2)
        paths["flash_dip"] = dip
    if nunspark:  # nunspark's own pieces of the same export
        if importlib.util.find_spec("nunspark") is None:
            raise RuntimeError(
                "nunspark is not installed: pip install 'mlx-flash-runtime[peers]' (or nunspark==0.13.0)"
            )
        packed = root / "nunspark"
        if not (packed / "manifest.json").is_file():
            shutil.rmtree(packed, ignore_errors=True)
            subprocess.run([*NUNSPARK, "pack", paths["mlx"], packed], check=True)
        paths["nunspark"] = packed
    return paths


# -- the systems ---------------------------------------------------------------------------------------
def llama_bench_cmd(gguf, prompt: int = 0, steps: int = 0, rounds: int = 1, extra=()) -> list:
    """llama-bench on `gguf`: a prompt test of `prompt` tokens, a decode test of `steps` (0: none), `rounds` times each,
    2 threads, JSON on stdout (printed synchronously: llama-completion's timing lines, from its logging thread, were
    sometimes lost at exit)."""
    args = (llama_cpp_bin("llama-bench"), "-m", gguf, "-p", prompt, "-n", steps, "-t", 2, "-r", rounds, "-o", "json")
    return [str(a) for a in (*args, *extra)]


def _llama_cmd(paths, steps, extra=()):
    # its tg test times `steps` decode steps after a one-token warm-up (which, like the others' one-token prompt,
    # faults the weights in)
    return llama_bench_cmd(paths["gguf"], steps=steps, extra=extra)


def _mlx_lm_cmd(paths, steps):
    return [
        sys.executable,
        STEPS,
        "mlx-lm",
        "--model",
        paths["mlx"],
        "--max-tokens",
        steps + 1,
        "--prompt",
        paths.get("prompt", PROMPT),
        "--ignore-chat-template",
        *sampling(paths),
    ]


def sampling(paths, seed=True):
    """Greedy, or for MoE models near-uniform random tokens (MOE_TEMP)."""
    if not paths.get("moe"):
        return ["--temp", 0]
    return ["--temp", MOE_TEMP, *(["--seed", 0] if seed else [])]


def _flash_cmd(dir_key, sparsity, *extra):
    def cmd(paths, steps, budget):
        return [
            sys.executable,
            STEPS,
            "mlx_flash",
            "--model",
            paths[dir_key],
            "--memory-budget",
            budget,
            "--sparsity",
            sparsity,
            "--max-tokens",
            steps + 1,
            "--prompt",
            paths.get("prompt", PROMPT),
            "--ignore-chat-template",
            "--stats",
            *sampling(paths),
            *extra,
        ]

    return cmd


NUNSPARK = [sys.executable, "-c", "import sys; from nunspark.cli import main; sys.exit(main())"]


def _nunspark_cmd(paths, steps, budget):
    return [
        sys.executable,
        STEPS,
        "nunspark",
        "generate",
        paths["nunspark"],
        "--prompt-ids",
        paths.get("prompt_id", 0),
        "--max-tokens",
        steps + 1,
        "--budget",
        str(budget),
        "--io-threads",
        8,
        "--warm-window",
        4,
        "--no-chat-template",
        "--metrics",
        *sampling(paths, seed=False),
    ]


# name -> (command builder (paths, decode steps, budget bytes), the path it runs on)
SYSTEMS = {
    "llama.cpp": (lambda p, n, b: _llama_cmd(p, n), "gguf"),
    "llama.cpp mmap": (lambda p, n, b: _llama_cmd(p, n, ["--repack", 0, "-lm", "mmap"]), "gguf"),
    "mlx-lm": (lambda p, n, b: _mlx_lm_cmd(p, n), "mlx"),
    "mlx_flash dense": (_flash_cmd("flash", "dense"), "flash"),
    "mlx_flash dip": (_flash_cmd("flash_dip", "dip"), "flash_dip"),
    "mlx_flash prompt-lookup": (_flash_cmd("flash", "dense", "--prompt-lookup"), "flash"),
    "mlx_flash no-prefetch": (_flash_cmd("flash", "dense", "--no-prefetch"), "flash"),  # nothing read ahead
    "nunspark": (_nunspark_cmd, "nunspark"),
}
RESIDENT = ("llama.cpp", "llama.cpp mmap", "mlx-lm")  # also run with no cap, the model in the page cache (--resident)
_FLASH_SUMMARY = re.compile(
    r"summary over \d+ tokens \(medians\): io ([\d.]+) ms.*?total ([\d.]+) ms"
    r"(?:.*? at ([\d.]+) (B|KiB|MiB|GiB)/s while reads were in flight)?"
)
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
_NUNSPARK_HITS = re.compile(r"cache hits / misses\s*: (\d+) / (\d+)")


def parse_flash_stats(out: str) -> dict:
    """From `generate --stats`: the I/O wait's share of a token (medians) and the readers' throughput while
    reads were in flight (bytes/s), or {}."""
    m = _FLASH_SUMMARY.search(out)
    if not m:
        return {}
    io, total = float(m.group(1)), float(m.group(2))
    return {
        "io_share": io / total if total else None,
        "read_bytes_per_s": float(m.group(3)) * _UNITS[m.group(4)] if m.group(3) else None,
    }


def parse_steps(system: str, out: str) -> dict:
    """From a system's output: {"generated": decode steps, "tok_s": steps / their time, "step_ms_mean",
    "step_ms_median", "prompt_tokens"[, cache hit rates]}, {} when it has none. llama-bench: its tg test's
    n_gen and avg_ts (one warm-up token; no per-step times); the others: steps.py's line."""
    if system.startswith("llama.cpp"):
        start, end = out.find("["), out.rfind("]")
        try:
            tests = json.loads(out[start : end + 1]) if start >= 0 else []
        except json.JSONDecodeError:
            return {}
        tg = [t for t in tests if t.get("n_gen")]
        if not tg:
            return {}
        return {
            "generated": tg[0]["n_gen"],
            "tok_s": tg[0]["avg_ts"],
            "step_ms_mean": 1e3 / tg[0]["avg_ts"],
            "step_ms_median": None,
            "prompt_tokens": 1,
        }
    line = next((x for x in reversed(out.splitlines()) if x.startswith("steps: ")), None)
    if line is None:
        return {}
    s = json.loads(line[len("steps: ") :])
    rec = {"generated": s.pop("steps"), **s}
    hits = _NUNSPARK_HITS.search(out)
    if hits and int(hits.group(1)) + int(hits.group(2)):
        rec["hit_rate"] = int(hits.group(1)) / (int(hits.group(1)) + int(hits.group(2)))
    return rec


def one_token_prompt(flash_dir, text: str = PROMPT):
    """(text, id) of `text`'s first token, the prompt every Python system gets: a text that encodes to it alone."""
    tok = load_tokenizer(FlashDir(flash_dir))
    first = tok.encode(text, add_special_tokens=False)[0]
    piece = tok.decode([first])
    if tok.encode(piece) != [first]:
        raise ValueError(f"{text!r}: its first token {piece!r} does not encode to itself alone")
    return piece, first


def resident_fits(path, baseline: int) -> bool:
    """Whether `path` (a file or directory) and the Python baseline fit in the memory available now."""
    p = Path(path)
    size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size
    return size + baseline <= _available_memory()


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            return next(int(x.split()[1]) * 1024 for x in f if x.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def read_into_page_cache(paths) -> None:
    """Read every file of `paths` once, so it is in the page cache (a resident run)."""
    for p in map(Path, paths):
        for f in [x for x in p.rglob("*") if x.is_file()] if p.is_dir() else [p]:
            with open(f, "rb") as fh:
                while fh.read(64 << 20):
                    pass


def measure_baseline(flash_dir) -> int:
    """Peak RSS of a Python interpreter with mlx_flash and mlx_lm imported and the model's tokenizer loaded
    (what every Python system pays before any weight; the baseline mlx_flash's budget is above: memory.py)."""
    r = run_capped(baseline_command(flash_dir), None)
    if not r.ok:
        raise RuntimeError(f"measuring the baseline failed: {r.stderr.strip()[-500:]}")
    own = re.search(r"VmHWM (\d+)", r.stdout)  # the child's own peak (memory.print_own_peak)
    return int(own.group(1)) * 1024 if own else r.max_rss


def run_one(system, paths, steps, budget, cap, files, timeout=None, resident: bool = False) -> dict:
    """One capped run of `steps` decode steps; `budget`: what the system is told (nunspark's own --budget for
    nunspark). `resident`: the system's model read into the page cache first (else `files` are dropped from it)."""
    builder, key = SYSTEMS[system]
    cmd = builder(paths, steps, budget)
    if resident:
        read_into_page_cache([paths[key]])
    r = run_capped(cmd, cap, drop=() if resident else files, timeout=timeout)
    out = r.stdout + "\n" + r.stderr
    timing = parse_steps(system, r.stdout if system.startswith("llama.cpp") else out)
    rec = {
        "system": system,
        "tokens": steps,
        "cap": cap,
        "returncode": r.returncode,
        "oom": r.oom_killed,
        "timed_out": r.timed_out,
        "read_bytes": r.read_bytes,
        "max_rss": r.max_rss,
        "cgroup_peak": r.cgroup_peak,
        "major_faults": r.major_faults,
        "wall_s": r.wall_s,
        "generated": None,
        "tok_s": None,
        **timing,
    }
    if not r.ok:
        rec["tok_s"] = None
    if system.startswith("mlx_flash"):
        rec.update(parse_flash_stats(out))
    if not r.ok and not r.oom_killed:
        rec["error"] = out.strip().splitlines()[-3:]
    return rec


def measure_routing(flash, root: Path, tokens: int = 64) -> Optional[dict]:
    """mlx_flash.tools.routing's statistics of an MoE flash directory on `tokens` random tokens (at a 25% budget:
    routing does not depend on it), kept in root/routing.json; None for a dense model or tokens = 0."""
    fd = FlashDir(flash)
    if fd.ffn.get("kind") != "moe" or not tokens:
        return None
    out = root / "routing.json"
    if out.is_file() and json.loads(out.read_text()).get("tokens") == tokens:
        return json.loads(out.read_text())
    subprocess.run(
        [
            str(a)
            for a in (
                sys.executable,
                "-m",
                "mlx_flash.tools.routing",
                "--model",
                flash,
                "--tokens",
                tokens,
                "--memory-budget",
                "25%",
                "--json",
                out,
            )
        ],
        check=True,
    )
    return json.loads(out.read_text())


def versions() -> dict:
    import mlx.core as mx
    import mlx_lm

    v = {
        "mlx_flash": __version__,
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "llama.cpp": f"vendored in llama-cpp-python {LLAMA_CPP_PYTHON}",
    }
    try:
        out = subprocess.run(
            [llama_cpp_bin("llama-completion"), "--version"], capture_output=True, text=True, timeout=30
        )
        v["llama.cpp"] += ": " + (out.stdout + out.stderr).strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        pass
    return v
