"""Flash runtime benchmark: the paper's ablation (Tables 2-3) on one model, in one run.

    python -m mlx_flash.bench [--model DIR | --synthetic llama-7b] --memory-budget 50% \
        [--tokens 128] [--prompt-tokens 256] [--quick] [--json out.json] [--plot out.png]

Configurations (each starts with cold caches: a fresh engine, O_DIRECT reads, so no page cache):

  naive       every FFN unit read each token: dense, no unit cache (budget = the minimum that loads),
              so all units overflow and are streamed in large sequential reads (its best case)
  hybrid      dense, as many units cached as the budget allows, the rest streamed every token
  hybrid-prefetch  hybrid with two buffers of the budget reading the next layer's uncached units
              while a layer computes (engine/read_ahead.py; what `load` does for --sparsity dense)
  sparsity    the sparsifier's active set read every token, no unit cache (no reuse)
  window-unbundled  sparsifier + window-k cache (k=5) under the budget, UNBUNDLED: one request per
              matrix (gate/up/down) per run of neighbouring units (see UnbundledReader)
  all         sparsifier + window-k cache + bundles (one request per unit, neighbours coalesced)
  mlx-lm      every weight in DRAM (the flash dir loaded resident), when it fits: the ceiling

Sparsifier: dip if the directory has the dip layout and calibration, else predictor if calibrated,
else oracle top-K |GLU| at --density (a stand-in: its own resident copy of gate/up, its time is
reported as "select ms" inside compute). Synthetic models (--synthetic) replay a SmolLM2 trace
(mlx_flash.calib.trace) mapped onto their layers: select ms ~ 0. The trace is the selector SmolLM2's
directory ships (its calibrated sketch) if it has one, else the oracle's, labelled as the upper bound.

The budget plan counts the sparsifier's own DRAM as `load` does (`sparsity.dram_bytes`): a calibrated
selector's arrays, the oracle stand-in's copy of gate/up, and for a replayed trace what its selector
would keep on THIS model (a sketch's bytes per gate/up weight x this model's gate/up weights; the
oracle's trace: nothing, the upper bound); if it does not fit at all, its configurations are reported
as skipped, with the reason. Each configuration runs on a model that streams what its own plan
streams (a selector's DRAM or read-ahead buffers can push attention layers out of DRAM): the model
is reloaded when that changes.

Per configuration: DRAM for weights (resident + unit caches, from the budget plan), flash->DRAM
bytes/token, effective read GB/s (bytes / I/O time), I/O, memory-management and compute ms/token,
total ms/token (median, p10, p90), cache hit rate, and the disk's own throughput measured in the
same run at the same mean request size and thread count: fio (psync, direct, numjobs = threads,
random reads over ffn.bin) when installed, and the native pool issuing the runtime's requests per
batch synchronously. The I/O target compares I/O ms with bytes / the fio figure (else the native).
"""

import argparse
import gc
import json
import os
import shutil
import sys
import time
from pathlib import Path

import mlx_flash  # noqa: F401  (OpenBLAS before mlx.core)

import mlx.core as mx
import numpy as np

from .budget import describe_streamed, fmt_bytes, min_budget, min_streaming_budget, plan_memory
from .calib.trace import Trace, TraceSparsifier, default_trace, describe_selector, gate_up_weights
from .default_model import model_dir
from .engine.neurons import NeuronEngine
from .engine.resident import stream_groups
from .engine.sparsity import Dense, dram_bytes
from .format.directory import FlashDir
from .generate import generate_step, speculative_generate_step
from .io import memory
from .io.reader import aligned_buffer, open_reader
from .loader import budget_bytes, cpu_cast, kv_size_of, load, load_resident, load_tokenizer, make_sparsifier
from .models.inspect import instantiate
from .speculative import PromptLookup, SpeculativeStats
from .texts import read_text
from .tools.bench_io import machine_info, run_fio
from .tools.plot import pyplot
from .tools.synthetic import build

CONFIGS = ("naive", "hybrid", "hybrid-prefetch", "speculative", "sparsity", "window-unbundled", "all", "mlx-lm")
DESCRIPTIONS = {
    "naive": "dense, no unit cache: every FFN unit read each token",
    "hybrid": "dense, budget filled with cached units, the rest streamed",
    "hybrid-prefetch": "hybrid, the next layer's uncached units read while a layer computes",
    "speculative": "hybrid-prefetch, prompt-lookup drafts verified k+1 positions a pass "
    "(lossless; per generated token)",
    "sparsity": "sparsifier, no unit cache (no reuse)",
    "window-unbundled": "sparsifier + window cache, one request per matrix per run of neighbours (unbundled)",
    "all": "sparsifier + window cache + bundling",
    "mlx-lm": "all weights in DRAM (ceiling)",
}


class TimedSparsifier:
    """Wraps a sparsifier and adds up the time spent choosing units (reported as select ms)."""

    def __init__(self, inner):
        self.inner, self.seconds = inner, 0.0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _timed(self, fn, *a):
        t = time.perf_counter()
        r = fn(*a)
        self.seconds += time.perf_counter() - t
        return r

    def select(self, *a):
        return self._timed(self.inner.select, *a)

    def select_inputs(self, *a):
        return self._timed(self.inner.select_inputs, *a)

    def select_neurons(self, *a):
        return self._timed(self.inner.select_neurons, *a)


class UnbundledReader:
    """Ablates bundling: reads units as `pieces` requests per run of neighbouring units (one per
    matrix: gate, up, down), as when every matrix is stored on its own (matrix-major): a matrix's
    rows of neighbouring neurons are still adjacent, so a run of k units adjacent in the file (and
    in the destination: misses get consecutive cache slots) costs `pieces` requests of k x the
    piece size instead of one of k x the stride. Units that are not neighbours are never merged
    (no gaps filled).

    The data is read from its real place in the bundled file (so the data and the tokens stay
    right): the run's bytes are split into `pieces` consecutive requests of those sizes; only the
    request pattern changes. Piece size: stride / pieces rounded down to the alignment, the last
    piece takes the remainder."""

    def __init__(self, reader, fd: FlashDir, pieces: int):
        self.reader, self.fd, self.pieces = reader, fd, pieces
        self.alignment = fd.unit_alignment  # pieces start where a matrix-major file would put them

    def __getattr__(self, name):
        return getattr(self.reader, name)

    def _split(self, offsets, lengths, dest, stride):
        a = self.alignment
        piece = max(a, stride // self.pieces // a * a)
        starts = [p * piece for p in range(self.pieces) if p * piece < stride]
        sizes = [(stride - lo) if k == len(starts) - 1 else piece for k, lo in enumerate(starts)]
        unit_o, unit_d = [], []
        for o, l, d in zip(offsets, lengths, dest):  # a request may span several units (streaming)
            k = np.arange(int(l) // stride, dtype=np.int64) * stride
            unit_o.append(o + k)
            unit_d.append(d + k)
        uo, ud = np.concatenate(unit_o), np.concatenate(unit_d)
        order = np.argsort(uo, kind="stable")
        uo, ud = uo[order], ud[order]
        first = np.flatnonzero(np.r_[True, (np.diff(uo) != stride) | (np.diff(ud) != stride)])  # runs
        k = np.diff(np.r_[first, len(uo)])[:, None]
        lo, size = np.array(starts, dtype=np.int64)[None], np.array(sizes, dtype=np.int64)[None]
        o = (uo[first][:, None] + k * lo).reshape(-1)
        d = (ud[first][:, None] + k * lo).reshape(-1)
        return o, (k * size).reshape(-1), d

    def submit(self, dest, offsets, lengths, dest_offsets, *, coalesce: bool = True):
        offsets, lengths, dest_offsets = (np.asarray(x, dtype=np.int64) for x in (offsets, lengths, dest_offsets))
        if len(offsets) == 0:
            return self.reader.submit(dest, offsets, lengths, dest_offsets, coalesce=False)
        stride = self.fd.layouts["neurons"].disk_stride
        return self.reader.submit(dest, *self._split(offsets, lengths, dest_offsets, stride), coalesce=False)

    def read(self, dest, offsets, lengths, dest_offsets, *, coalesce: bool = True):
        return self.reader.wait(self.submit(dest, offsets, lengths, dest_offsets))


# -- engines -------------------------------------------------------------------------------


def resident_bytes(fd) -> int:
    return fd.resident_nbytes(cpu_cast)


def engine_plan(fd, budget: int, context: int, extra: int = 0, prefetch: bool = False):
    """The budget plan of one configuration (float32 activations, as `load` plans on the CPU)."""
    return plan_memory(
        fd,
        budget,
        context,
        kv_size_of(fd),
        extra,
        resident=resident_bytes(fd),
        groups=stream_groups(fd, instantiate(fd.config), cpu_cast, context),
        prefetch=prefetch,
    )


def make_engine(
    model,
    fd,
    reader,
    sparsifier,
    budget: int,
    context: int,
    policy="window",
    window=5,
    unit_cache=True,
    prefetch=False,
    extra: int = 0,
):
    """A fresh NeuronEngine (cold caches) for `budget`, with `extra` bytes of it the sparsifier's, swapped
    into every layer of `model`.

    unit_cache=False: no FFN unit cached (the naive and sparsity-only configurations). Streamed
    resident weights (the model was loaded with this plan's, see `run`) stay streamed (attach moves the streamer)."""

    plan = engine_plan(fd, budget, context, extra, prefetch)
    if not unit_cache:
        plan.capacity = [{name: 0 for name in caps} for caps in plan.capacity]
    engine = NeuronEngine.from_plan(fd, plan, reader, sparsifier, policy, window)
    old = engine.attach(model)
    if old is not None and old is not engine:
        old.caches = None  # free the previous configuration's cache buffers
    return engine


def decode(model, prompt, n: int, on_prefill=None, spec=None):
    """Greedily generate `n` tokens after `prompt` with the loop users run (`generate.generate_step`, mlx-lm's
    greedy sampler; with `spec`, a SpeculativeStats, `speculative_generate_step` with prompt lookup); returns each
    decode token's wall time (between the loop's yields). `on_prefill` runs once the prompt's pass has yielded the
    first token, before any decode pass."""
    times, t = [], None
    steps = (
        generate_step(mx.array(prompt), model, max_tokens=n + 1)
        if spec is None
        else speculative_generate_step(mx.array(prompt), model, PromptLookup(), max_tokens=n + 1, spec_stats=spec)
    )
    for i, _ in enumerate(steps):
        if i == 0:
            if on_prefill:
                on_prefill()
        else:
            times.append(time.perf_counter() - t)
        t = time.perf_counter()
    return times


# -- the disk's own figure -------------------------------------------------------------------


def disk_throughput(path, block: int, threads: int, per_batch: int, seconds: float = 1.0, seed: int = 0) -> float:
    """GB/s of random aligned O_DIRECT reads of `block` bytes, `per_batch` requests per synchronous
    batch on `threads` threads (what the runtime issues), over the file `path`."""
    size = os.path.getsize(path)
    block = max(512, min(block, size // 2) // 512 * 512)
    per_batch = max(1, int(per_batch))
    rng = np.random.default_rng(seed)
    base, off = aligned_buffer(block * per_batch)
    dest = off + np.arange(per_batch, dtype=np.int64) * block
    lengths = np.full(per_batch, block, dtype=np.int64)
    n, t0 = 0, time.perf_counter()
    with open_reader(path, threads=threads, direct=True) as r:
        while time.perf_counter() - t0 < seconds or n == 0:
            offsets = rng.integers(0, size // block, per_batch, dtype=np.int64) * block
            r.read(base, offsets, lengths, dest, coalesce=False)
            n += per_batch
    return n * block / (time.perf_counter() - t0) / 1e9


def fio_throughput(path, block: int, threads: int, seconds: float = 1.0):
    if shutil.which("fio") is None:
        return None

    try:
        size = os.path.getsize(path) // block * block
        return run_fio(str(path), size, max(512, block // 512 * 512), threads, seconds)[0] * 2**30 / 1e9
    except Exception:  # noqa: BLE001 - a reference figure, never fatal
        return None


# -- one configuration -------------------------------------------------------------------------


def summarize(
    engine, times, fd, reader_stats, select_s: float, threads: int, disk_seconds: float, use_fio: bool, spec=None
):
    engine.stats.end()
    passes = spec.passes if spec is not None else len(times)
    toks = engine.stats.decode_tokens()[-passes:]  # the timed passes (not the last prompt token)
    stride = fd.layouts["neurons"].disk_stride  # bytes read per unit (encoded layouts: less than a cache row)
    n = len(toks)
    io = np.array([t.io_s for t in toks]) * 1e3
    mm = np.array([t.mm_s for t in toks]) * 1e3
    expand = np.array([t.expand_s for t in toks]) * 1e3
    total = np.array([t.total_s for t in toks]) * 1e3
    comp = np.array([t.compute_s for t in toks]) * 1e3
    bytes_tok = np.array([t.bytes_read for t in toks], dtype=np.float64)
    hits, misses = sum(t.hits for t in toks), sum(t.misses for t in toks)
    plan = engine.plan
    strides = fd.strides
    cache = plan.cache_bytes(strides) + plan.prefetch_bytes(strides)
    req = reader_stats.get("requests", 0)
    mean_req = reader_stats["bytes_read"] / req if req else 0
    per_batch = req / max(1, reader_stats.get("batches", 1))  # requests per read() call
    out = {
        "tokens": n,
        "dram_weights_bytes": plan.resident + cache + plan.extra,
        "resident_bytes": plan.resident,
        "cache_bytes": cache,
        "selector_bytes": plan.extra,
        "streamed": describe_streamed(plan.streamed) if plan.streamed else None,
        "streamed_attention_layers": sum(g.kind == "layer" for g in plan.streamed),
        "budget_bytes": plan.budget,
        "cache_units_per_layer": plan.capacity[0].get("neurons", 0),
        "bytes_per_token": float(bytes_tok.mean()) if n else 0.0,  # at the device
        "bytes_requested_per_token": float(np.mean([t.bytes_requested for t in toks])) if n else 0.0,
        "streamed_bytes_per_token": float(np.mean([t.streamed_bytes for t in toks])) if n else 0.0,
        "misses_per_token": misses / max(1, n),
        "stride": stride,
        "io_ms": float(np.median(io)),
        "mm_ms": float(np.median(mm)),
        "compute_ms": float(np.median(comp)),
        "expand_ms": float(np.median(expand)) if n else 0.0,
        "select_ms": select_s * 1e3 / max(1, n),
        "total_ms": float(np.median(total)),
        "total_ms_p10": float(np.percentile(total, 10)),
        "total_ms_p90": float(np.percentile(total, 90)),
        "total_ms_mean": float(total.mean()),
        "io_ms_mean": float(io.mean()),
        "hit_rate": hits / (hits + misses) if hits + misses else 1.0,
        "active_per_layer": float(np.mean([np.mean(t.active) for t in toks if t.active])) if n else 0.0,
        "read_gbps": float(bytes_tok.sum() / (io.sum() / 1e3) / 1e9) if io.sum() > 0 else None,
        "requests_per_token": req / max(1, n),
        "mean_request_bytes": mean_req,
        "requests_per_batch": per_batch,
        "reader_bytes_read": reader_stats["bytes_read"],
        "peak_rss_bytes": engine.stats.peak_rss(),  # the whole process, above the baseline load recorded
    }
    if spec is not None:  # per generated token, not per pass: means (a pass yields several)
        g = max(1, spec.generated)
        out.update(
            spec.summary(),
            tokens=g,
            bytes_per_token=float(bytes_tok.sum()) / g,
            io_ms=float(io.sum()) / g,
            mm_ms=float(mm.sum()) / g,
            compute_ms=float(comp.sum()) / g,
            total_ms=float(np.sum(times)) * 1e3 / g,
            total_ms_mean=float(np.sum(times)) * 1e3 / g,
            io_ms_mean=float(io.sum()) / g,
            misses_per_token=misses / g,
            select_ms=select_s * 1e3 / g,
            bytes_requested_per_token=sum(t.bytes_requested for t in toks) / g,
            streamed_bytes_per_token=sum(t.streamed_bytes for t in toks) / g,
            requests_per_token=req / g,
        )
    if mean_req:
        disk = disk_throughput(fd.largest_unit_path, int(mean_req), threads, per_batch, disk_seconds)
        out["disk_gbps"] = disk
        out["fio_gbps"] = (
            fio_throughput(fd.largest_unit_path, int(mean_req), threads, disk_seconds) if use_fio else None
        )
        # the disk's figure: fio at this request size and thread count when installed, else the native pool
        ref = out["fio_gbps"] or disk
        out["io_ms_at_disk_speed"] = float(bytes_tok.mean() / (ref * 1e9) * 1e3)
        out["io_vs_disk"] = out["io_ms_mean"] / out["io_ms_at_disk_speed"] if out["io_ms_at_disk_speed"] else None
    return out


def run_dense(path, prompt, n):
    """The ceiling: every weight in DRAM (float32 activations as the flash runtime on CPU)."""
    model, fd = load_resident(path, mx.float32)
    times = np.array(decode(model, prompt, n)) * 1e3
    nbytes = fd.model_bytes  # weights as stored (norms / embedding scales are float32 in DRAM: a little more)
    del model
    return {
        "tokens": n,
        "dram_weights_bytes": nbytes,
        "resident_bytes": nbytes,
        "cache_bytes": 0,
        "bytes_per_token": 0.0,
        "io_ms": 0.0,
        "mm_ms": 0.0,
        "compute_ms": float(np.median(times)),
        "select_ms": 0.0,
        "total_ms": float(np.median(times)),
        "total_ms_mean": float(times.mean()),
        "total_ms_p10": float(np.percentile(times, 10)),
        "total_ms_p90": float(np.percentile(times, 90)),
        "hit_rate": 1.0,
        "read_gbps": None,
    }


def mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# -- driver --------------------------------------------------------------------------------------


def choose_sparsifier(fd, density, trace=None):
    """(sparsifier, description): trace replay, else dip / predictor / oracle as calibrated."""

    if trace is not None:
        tr, src = trace
        sp = TraceSparsifier(tr, len(fd.layers), fd.ffn["intermediate_size"], weights=gate_up_weights(fd))
        return sp, (
            f"trace replay of {src} ({describe_selector(tr.meta)}, density {tr.meta.get('density')}, "
            f"{tr.n_layers} layers x {tr.n_units} neurons mapped onto {len(fd.layers)} x "
            f"{fd.ffn['intermediate_size']}; its DRAM here {fmt_bytes(sp.nbytes)})"
        )
    calib = fd.manifest.get("sparsity") or {}
    if fd.ffn.get("layout") == "dip":
        raise SystemExit("bench needs the neurons layout (its dense baselines cannot run on a dip-layout directory)")
    sel = calib.get("selector")
    if sel is not None and sel["name"] not in ("dip", "wina"):  # the selector the directory ships
        return make_sparsifier(fd, sel["name"]), f"{sel['name']} (calibrated)"
    if "predictor" in calib and sel is None:
        return make_sparsifier(fd, "predictor"), "predictor (calibrated)"
    return make_sparsifier(fd, "oracle", density), (
        f"oracle top-K |GLU| at density {density} (stand-in: the directory has no predictor/dip calibration)"
    )


def run(
    path,
    memory_budget="auto",
    tokens=128,
    prompt_tokens=256,
    configs=CONFIGS,
    density=0.2,
    trace=None,
    threads=None,
    window=5,
    disk_seconds=1.0,
    use_fio=True,
    prompt=None,
    progress=True,
    rounds=1,
):
    """Run the configurations on the flash directory `path`; returns the result dict (see module doc).

    rounds > 1: the flash configurations run `rounds` times, alternating, so that a slow spell of
    a shared machine or disk hits all of them; each reports its median round (by total ms)."""

    fd = FlashDir(path)
    context = prompt_tokens + tokens + 8
    budget = budget_bytes(memory_budget, fd)
    resident, kv_size = resident_bytes(fd), kv_size_of(fd)
    groups = stream_groups(fd, instantiate(fd.config), cpu_cast, context)
    floor = min_budget(fd, context, kv_size, resident=resident)
    lowest = min_streaming_budget(fd, context, kv_size, resident=resident, groups=groups)
    if budget < lowest:
        raise SystemExit(
            f"memory budget {fmt_bytes(budget)} is below the smallest that loads ({fmt_bytes(lowest)}, "
            f"{lowest / fd.model_bytes:.0%} of the model, with attention and embeddings streamed)"
        )
    load_tokenizer(fd)  # as `load` does, the baseline is taken after the tokenizer (and its imports)
    baseline = memory.rss()  # before the sparsifier's arrays: they are in the budget, so in the peak
    sparse, sparse_desc = choose_sparsifier(fd, density, trace)
    dense = Dense(fd.ffn["intermediate_size"])
    sparse_bytes = dram_bytes(sparse)
    sparse_lowest = min_streaming_budget(fd, context, kv_size, sparse_bytes, resident=resident, groups=groups)
    no_fit = None
    if budget < sparse_lowest:
        no_fit = (
            f"the selector's DRAM ({fmt_bytes(sparse_bytes)}) does not fit the budget: with it the smallest "
            f"budget that loads is {fmt_bytes(sparse_lowest)} ({sparse_lowest / fd.model_bytes:.0%} of the model)"
        )
        if progress:
            print(f"[bench] {no_fit}; its configurations are skipped", file=sys.stderr)
    if prompt is None:
        rng = np.random.default_rng(0)
        prompt = rng.integers(0, fd.config["vocab_size"], prompt_tokens).tolist()
    prompt = list(prompt)[:prompt_tokens]
    pieces = len(fd.ffn["matrices"])
    setups = {  # sparsifier, unbundled reader, unit cache, prefetch
        "naive": (dense, False, False, False),
        "hybrid": (dense, False, True, False),
        "hybrid-prefetch": (dense, False, True, True),
        "speculative": (dense, False, True, True),
        "sparsity": (sparse, False, False, False),
        "window-unbundled": (sparse, True, True, False),
        "all": (sparse, False, True, False),
    }

    def release(model):  # its caches, readers and weights
        model.flash.caches = None
        model.flash.close()

    def paths(plan):
        return [g.path for g in plan.streamed]

    model = reader = streamed = None
    runs = {name: [] for name in configs if name != "mlx-lm"}
    for round_ in range(rounds):
        for name in runs:
            sp, unbundled, unit_cache, prefetch = setups[name]
            if sp is sparse and no_fit:
                runs[name].append({"skipped": no_fit})
                continue
            extra = dram_bytes(sp)
            plan = engine_plan(fd, budget, context, extra, prefetch)
            if model is None or paths(model.flash.plan) != paths(plan):
                # the model streams what this plan streams (below the resident floor, read-ahead buffers or a
                # selector's DRAM push attention layers out): loaded with the same plan
                if model is not None:
                    release(model)
                    model = None
                    gc.collect()
                    mx.clear_cache()
                model = load(
                    path,
                    memory_budget=budget,
                    sparsifier=sp if extra else dense,
                    context=context,
                    threads=threads,
                    prefetch=prefetch,
                    dtype=mx.float32,
                )[0]
                model.flash.caches = None  # make_engine allocates its own
                if paths(model.flash.plan) != paths(plan):
                    raise RuntimeError(f"bench: the model streams {paths(model.flash.plan)}, its plan {paths(plan)}")
                reader = model.flash.reader
                streamed = plan.streamed if streamed is None else streamed
            rd = UnbundledReader(reader, fd, pieces) if unbundled else reader
            if hasattr(sp, "reset"):
                sp.reset(0)
            timed = TimedSparsifier(sp)
            engine = make_engine(model, fd, rd, timed, budget, context, "window", window, unit_cache, prefetch, extra)
            engine.stats.baseline_rss = baseline
            gc.collect()  # the previous engine (a cycle with its read-ahead) and its buffers: not this one's peak
            mx.clear_cache()
            memory.reset_peak()
            if progress:
                print(
                    f"[bench] {name}{f' (round {round_ + 1}/{rounds})' if rounds > 1 else ''}: {DESCRIPTIONS[name]}",
                    file=sys.stderr,
                )

            def after_prefill():
                reader.reset_stats()
                timed.seconds = 0.0

            spec = SpeculativeStats() if name == "speculative" else None
            times = decode(model, prompt, tokens, after_prefill, spec)
            r = summarize(engine, times, fd, reader.stats(), timed.seconds, reader.threads, disk_seconds, use_fio, spec)
            r["description"] = DESCRIPTIONS[name]
            runs[name].append(r)
    results = {}
    for name, rs in runs.items():  # the median round; every round's total kept
        if "skipped" in rs[0]:
            results[name] = rs[0]
            continue
        results[name] = sorted(rs, key=lambda r: r["total_ms"])[len(rs) // 2]
        results[name]["rounds_total_ms"] = [r["total_ms"] for r in rs]
    if model is not None:
        release(model)
    if "mlx-lm" in configs:
        need = fd.model_bytes * 2  # float32 casts of norms/scales + the flash model still loaded
        if need < mem_available() * 0.8:
            if progress:
                print("[bench] mlx-lm: all weights in DRAM", file=sys.stderr)
            results["mlx-lm"] = run_dense(path, prompt, tokens)
            results["mlx-lm"]["description"] = DESCRIPTIONS["mlx-lm"]
        else:
            results["mlx-lm"] = {
                "skipped": f"does not fit: needs ~{fmt_bytes(need)}, {fmt_bytes(mem_available())} free"
            }
    out = {
        "model": str(path),
        "model_bytes": fd.model_bytes,
        "ffn_bytes": fd.ffn_bytes,
        "resident_bytes_loaded": resident,
        "memory_budget": memory_budget,
        "budget_bytes": budget,
        "min_budget_bytes": lowest,
        "resident_floor_bytes": floor,
        "streamed": describe_streamed(streamed) if streamed else None,
        "tokens": tokens,
        "prompt_tokens": len(prompt),
        "threads": getattr(reader, "threads", threads),
        "window": window,
        "max_gap_bytes": getattr(reader, "max_gap_bytes", None),
        "sparsifier": sparse_desc,
        "selector_bytes": sparse_bytes,
        "selector_min_budget_bytes": sparse_lowest,
        "stride": fd.layouts["neurons"].disk_stride,
        "row_stride": fd.layouts["neurons"].stride,
        "units_per_layer": fd.ffn["intermediate_size"],
        "layers": len(fd.layers),
        "configs": results,
    }
    out["targets"] = targets(results)
    return out


def targets(res) -> dict:
    """Targets for sparsity + window + bundling ("all"): I/O bytes and latency against naive and dense reads."""
    t = {}
    res = {k: r for k, r in res.items() if "skipped" not in r}
    a, nv, hy = res.get("all"), res.get("naive"), res.get("hybrid")
    if a and nv and a.get("bytes_per_token"):
        t["io_bytes_naive_over_all"] = nv["bytes_per_token"] / a["bytes_per_token"]
        t["io_bytes_target_6x_met"] = t["io_bytes_naive_over_all"] >= 6
    if a and hy:
        # rounds: the median of each round's ratio (hybrid and all ran back to back) when there are several
        pairs = [h / x for h, x in zip(hy.get("rounds_total_ms", []), a.get("rounds_total_ms", []))]
        t["latency_hybrid_over_all"] = float(np.median(pairs)) if len(pairs) > 1 else hy["total_ms"] / a["total_ms"]
        if len(pairs) > 1:
            t["latency_hybrid_over_all_rounds"] = pairs
        t["latency_target_3x_met"] = t["latency_hybrid_over_all"] >= 3
    hp = res.get("hybrid-prefetch")
    if hy and hp:  # the same dense reads, serial vs read ahead: the I/O hidden behind compute
        t["latency_hybrid_over_hybrid_prefetch"] = hy["total_ms"] / hp["total_ms"]
    dense = hp or hy  # dense mode as `load` runs it (read-ahead), else without
    if a and dense and dense.get("bytes_per_token"):  # the shipped selector: <= 1/3 of dense mode's bytes
        t["io_bytes_all_over_dense"] = a["bytes_per_token"] / dense["bytes_per_token"]
        t["io_bytes_third_of_dense_met"] = t["io_bytes_all_over_dense"] <= 1 / 3
    if a and a.get("io_vs_disk"):
        t["io_vs_disk"] = a["io_vs_disk"]
        t["io_target_1.5x_met"] = a["io_vs_disk"] <= 1.5
    return t


# -- output ----------------------------------------------------------------------------------------


def _f(v, fmt="{:.1f}"):
    return "-" if v is None else fmt.format(v)


def table(res) -> str:
    rows = [
        "| config | DRAM weights | flash->DRAM / token | read GB/s | disk GB/s (same size) | I/O ms | mm ms | "
        "compute ms (select) | total ms (p10-p90) | hit rate |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in res["configs"].items():
        if "skipped" in r:
            rows.append(f"| {name} | {r['skipped']} | | | | | | | | |")
            continue
        disk = r.get("disk_gbps")
        fio = r.get("fio_gbps")
        disk_s = (
            "-"
            if disk is None
            else f"{disk:.2f}" + (f" (fio {fio:.2f})" if fio else "") + f" @ {fmt_bytes(r['mean_request_bytes'])}"
        )
        streamed = (
            f" (resident weights {fmt_bytes(r['streamed_bytes_per_token'])})"
            if r.get("streamed_bytes_per_token")
            else ""
        )
        selector = f" (selector {fmt_bytes(r['selector_bytes'])})" if r.get("selector_bytes") else ""
        rows.append(
            f"| {name} | {fmt_bytes(r['dram_weights_bytes'])}{selector} | "
            f"{fmt_bytes(r['bytes_per_token'])}{streamed} | "
            f"{_f(r.get('read_gbps'), '{:.2f}')} | {disk_s} | {r['io_ms']:.1f} | {r['mm_ms']:.1f} | "
            f"{r['compute_ms']:.1f} ({r['select_ms']:.1f}) | {r['total_ms']:.1f} ({r['total_ms_p10']:.1f}-"
            f"{r['total_ms_p90']:.1f}) | {r['hit_rate']:.1%} |"
        )
    return "\n".join(rows)


def figure(res, title=None):
    """The stacked-bar latency breakdown (ms/token per configuration) as a matplotlib Figure."""
    plt = pyplot(headless=False)

    names = [n for n, r in res["configs"].items() if "skipped" not in r]
    io = np.array([res["configs"][n]["io_ms"] for n in names])
    mm = np.array([res["configs"][n]["mm_ms"] for n in names])
    sel = np.array([res["configs"][n]["select_ms"] for n in names])
    comp = np.maximum(0, np.array([res["configs"][n]["compute_ms"] for n in names]) - sel)
    fig, ax = plt.subplots(figsize=(8, 5))
    x = np.arange(len(names))
    ax.bar(x, io, label="I/O")
    ax.bar(x, mm, bottom=io, label="memory management")
    ax.bar(x, comp, bottom=io + mm, label="compute")
    if sel.any():
        ax.bar(x, sel, bottom=io + mm + comp, label="select (sparsifier)")
    ax.set_xticks(x, names, rotation=20)
    ax.set_ylabel("ms / token (medians)")
    ax.set_title(title or f"{Path(res['model']).name}, budget {res['memory_budget']}")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=4, frameon=False)
    fig.tight_layout()
    return fig


def plot(res, out, title=None):
    """`figure` saved to the file `out` (headless: the Agg backend)."""
    plt = pyplot()

    fig = figure(res, title)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def setup_arg_parser():
    p = argparse.ArgumentParser(
        description="Benchmark the flash runtime: naive, hybrid, sparsity, windowing, bundling."
    )
    p.add_argument("--model", default=None, help="Flash directory (default: SmolLM2, converted once).")
    p.add_argument("--synthetic", default=None, help="Build/use a synthetic model: llama-7b, opt-6.7b, llama-1b, tiny.")
    p.add_argument("--memory-budget", default="auto", help='Weights + caches + KV: bytes, "2GB", "50%%" or auto.')
    p.add_argument(
        "--tokens", type=int, default=None, help="Decoded tokens per configuration (default 128; --quick 32)."
    )
    p.add_argument("--prompt-tokens", type=int, default=None, help="Prompt tokens (default 256; --quick 16).")
    p.add_argument("--quick", action="store_true", help="32 tokens after a 16-token prompt, 0.5 s disk measurements.")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"Comma-separated subset of {','.join(CONFIGS)}.")
    p.add_argument("--density", type=float, default=0.2, help="Oracle stand-in / recorded trace density.")
    p.add_argument(
        "--trace", default=None, help="Replay this trace (.npz from mlx_flash.calib.trace) instead of a sparsifier."
    )
    p.add_argument("--threads", type=int, default=None, help="Reader threads (default: the reader's default).")
    p.add_argument("--window", type=int, default=5)
    p.add_argument("--no-fio", action="store_true")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="Run the flash configurations this many times, alternating; report each one's median round.",
    )
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    return p


def main(argv=None):
    a = setup_arg_parser().parse_args(argv)
    tokens = a.tokens or (32 if a.quick else 128)
    prompt_tokens = a.prompt_tokens or (16 if a.quick else 256)
    configs = [c for c in a.configs.split(",") if c]
    bad = set(configs) - set(CONFIGS)
    if bad:
        raise SystemExit(f"unknown configs {sorted(bad)} (choose from {', '.join(CONFIGS)})")

    trace, prompt, kind = None, None, "real"
    if a.synthetic:
        path = build(a.synthetic)
        trace = (Trace.load(a.trace), a.trace) if a.trace else default_trace(a.density)
        kind = "synthetic"
    else:
        path = model_dir(a.model)
        if a.trace:
            trace = (Trace.load(a.trace), a.trace)
        tok = load_tokenizer(FlashDir(path))  # a real prompt: WikiText-2 test, away from the trace's text
        prompt = tok.encode(read_text()[50000 : 50000 + 20 * prompt_tokens])[:prompt_tokens]
    res = run(
        path,
        a.memory_budget,
        tokens,
        prompt_tokens,
        configs,
        a.density,
        trace,
        a.threads,
        a.window,
        0.5 if a.quick else 1.0,
        not a.no_fio,
        prompt,
        rounds=a.rounds,
    )

    res["kind"] = kind
    res["command"] = "python -m mlx_flash.bench " + " ".join(sys.argv[1:] if argv is None else argv)
    res["machine"] = machine_info(str(Path(path)))
    print(f"\n{res['command']}")
    print(
        f"{kind} model {res['model']}: {fmt_bytes(res['model_bytes'])} of weights (FFN on flash "
        f"{fmt_bytes(res['ffn_bytes'])}), budget {res['memory_budget']} = {fmt_bytes(res['budget_bytes'])} "
        f"(smallest that loads {fmt_bytes(res['min_budget_bytes'])}); {res['tokens']} tokens after a "
        f"{res['prompt_tokens']}-token prompt; {res['threads']} reader threads; sparsifier: {res['sparsifier']}"
    )
    m = res["machine"]["cpu_matvecs"]
    print(
        f"decode matvecs: {'native CPU kernels' if m['on'] else 'MLX ops'} ({json.dumps(m)}); "
        f"BLAS: {res['machine']['blas']}"
    )
    if res.get("streamed"):
        print(
            f"below the resident floor ({fmt_bytes(res['resident_floor_bytes'])}), "
            f"streamed every token: {res['streamed']}"
        )
    print(table(res))
    if a.rounds > 1:
        print(
            "total ms per round: "
            + "; ".join(
                f"{k} {', '.join(f'{t:.0f}' for t in r['rounds_total_ms'])}"
                for k, r in res["configs"].items()
                if "rounds_total_ms" in r
            )
        )
    print("targets:", json.dumps(res["targets"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    if a.plot:
        plot(res, a.plot, f"{kind}: {Path(res['model']).name}, budget {res['memory_budget']}")
    return res


if __name__ == "__main__":
    main()
