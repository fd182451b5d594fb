"""mlx_flash against the systems a user would otherwise pick, under a hard memory cap.

    python -m mlx_flash.peers [--model small|llama-7b|qwen3-30b-a3b|moe-small|GGUF] [--budgets 25,50,80] [--rounds N]
        [--tokens N] [--routing uniform|skewed|own] [--json OUT] [--plot OUT.png] [--quick]

For each budget (a fraction of the model's weight bytes: the size of its GGUF file, the source
all three systems run), every system generates from the same weights in a memory cgroup capped at

    cap = budget + baseline,   baseline = peak RSS of python with mlx_flash, mlx_lm and the model's tokenizer

(the interpreter and libraries every Python system pays; llama.cpp gets the same cap). The
page cache of every model file is dropped before each run, and the cgroup is charged for what
the run caches, so mmap readers pay for their cache as on a machine with that much memory.

Systems (all on the same weights: the GGUF, its mlx_flash conversion, and that conversion
exported for mlx-lm by mlx_flash.convert.export; their commands, models and one capped run are in
mlx_flash.tools.peers_systems):
  llama.cpp             llama-bench's tg test with its defaults (2 threads): weights repacked into
                        anonymous memory on x86 (AVX2), so a cap below the model kills it
  llama.cpp mmap        the same with --repack 0 -lm mmap: weights used in place from the mmap'd file
  mlx-lm                python -m mlx_lm generate on the export
  mlx_flash dense       python -m mlx_flash.generate --memory-budget <budget> --sparsity dense
  mlx_flash prompt-lookup  mlx_flash dense with --prompt-lookup (speculative decoding, lossless; nunspark has
                        draft-model and EAGLE speculation but no prompt lookup: no same-draft row beside it)
  mlx_flash dip         --sparsity dip on a dip-layout conversion calibrated by mlx_flash.calibrate
                        (SmolLM2 only: the synthetic 7B has random weights, nothing to calibrate)
  nunspark              nunspark generate (PyPI: an MLX runtime that streams layers and experts from SSD) on
                        `nunspark pack` of the export, --io-threads 8 --warm-window 4. Its --budget does not
                        bound the process, so it starts at NUNSPARK_SHARE of the cap's budget and, when
                        OOM-killed, runs again with 3/4 of that budget until it holds the cap (the largest
                        budget that holds it, in those steps)
A budget is a % of the GGUF's size (cap = budget + baseline) or an absolute hard cap such as 2.5GiB
(budget = cap - baseline): one cap for every system.
If mlx_flash is OOM-killed under its cap, it is run again with a cap 25% larger (then larger
again, in 25% steps, until it finishes) and recorded as a separate row labelled with the factor.

Timing, the same for every system: one token of prompt, then --tokens decode steps (one token each), and
tokens/s = decode steps / their time (load and the prompt's pass excluded). llama-bench's tg test is that
already (-n N: its warm-up decodes one token, then N timed steps, a random token each); the Python systems run
their own command through mlx_flash/tools/steps.py, which times each token's arrival from their generation
loop: --max-tokens N + 1 with a prompt of one token (the first token of --prompt; the first generated token
comes out of the prompt's pass), per-step median beside the mean (llama-bench reports the mean only).
Resident baselines (--resident; the "resident" column and the JSON's "resident"): no cap and every model file
read into the page cache first, llama.cpp (default and mmap) and mlx-lm where model + baseline fit in the
memory available.

Measured per run (mlx_flash.tools.cap): tokens/s, per-step mean and median, peak RSS, the cgroup's peak (page
cache included), OOM kill; mlx_flash's cache hit rate over the decode steps, cold start (until its caches first
fill) and steady state (after) apart; nunspark's cache hit rate as it prints it. Bytes read from the device per
decode step: (device bytes of an N-step run - those of a 1-step run) / (N - 1), the 1-step run done once per
system and budget, so loading and the prompt cancel out. Medians over --rounds rounds; each round runs every
system at every budget, in an order rotated each round, because the disk is noisy.

MoE presets are written with a routing regime (--routing, synthetic.py's: uniform by default, the floor a user
can count on; skewed; own, sticky); the regime and its routing statistics (mlx_flash.tools.routing on 64 random
tokens: consecutive reuse, per-expert frequency, LRU hit rates) are in the JSON and the header.
"""

import argparse
import json
import re
import shutil
import statistics
import sys
from pathlib import Path
from typing import Optional

from tqdm import tqdm

from .budget import fmt_bytes, parse_size
from .format.directory import FlashDir
from .io.reader import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_THREADS
from .models.architectures import adapter_for
from .tools.bench_io import machine_info, run_fio
from .tools.cap import exit_on_sigterm
from .tools.peers_systems import (
    PROMPT,
    RESIDENT,
    SYSTEMS,
    measure_baseline,
    measure_routing,
    one_token_prompt,
    prepare,
    resident_fits,
    routing_of,
    run_one,
    sampling,
    versions,
)
from .tools.plot import pyplot
from .tools.routing import describe as describe_routing
from .tools.synthetic import ROUTINGS

OOM_RETRY = 1.25  # an OOM-killed mlx_flash runs again under a cap this much larger (then again)
MAX_RETRIES = 4
NUNSPARK_SHARE = 0.6  # nunspark's first --budget, of the cap's budget (1.0-1.5 GB held a 2.5 GiB cap; 2.2 did not)
NUNSPARK_BACKOFF = 0.75


def fio_reference(path: Path, threads: int, seconds: float = 3.0) -> Optional[dict]:
    """fio's random O_DIRECT reads of the runtime's request size (1 MiB) with its thread count, on the flash
    directory's own ffn.bin (read only): what the readers' throughput is compared with. None without fio."""

    if shutil.which("fio") is None or path.stat().st_size < DEFAULT_MAX_REQUEST_BYTES:
        return None
    gib_s, iops = run_fio(str(path), path.stat().st_size, DEFAULT_MAX_REQUEST_BYTES, threads, seconds)
    return {"block": DEFAULT_MAX_REQUEST_BYTES, "threads": threads, "bytes_per_s": gib_s * 2**30, "iops": iops}


def run(
    model="small",
    budgets=(25, 50, 80),
    rounds=3,
    tokens=32,
    systems=None,
    timeout=1800,
    progress=True,
    log=None,
    resident=RESIDENT,
    out=None,
    cap_factor: float = 1.0,
    prompt: str = PROMPT,
    routing: str = "uniform",
    routing_tokens: int = 64,
) -> dict:
    """Every system at every budget, `rounds` times, `tokens` decode steps a run; `out`: a JSON file rewritten
    after every run (a long run that is stopped keeps what it measured). cap_factor != 1: every cap scaled by
    it, and every capped row labelled "(cap xF)". `resident`: systems also run with no cap, their model in the
    page cache (mlx-lm only where it fits). `routing`: a synthetic MoE preset's regime."""

    needs = set(systems or ()) | set(resident or ())
    paths = prepare(
        model, progress, nunspark="nunspark" in needs, routing=routing, mlx=not systems or "mlx-lm" in needs
    )
    systems = [s for s in (systems or SYSTEMS) if SYSTEMS[s][1] in paths]
    weights = paths["gguf"].stat().st_size  # the source model, the same absolute cap for every system
    baseline = measure_baseline(paths["flash"])
    files = [p for p in paths.values() if p.exists()]  # (the mlx-lm export exists only where a system needs it)
    paths["prompt"], paths["prompt_id"] = one_token_prompt(paths["flash"], prompt)  # llama-bench: -p 0, a warm-up token
    fd = FlashDir(paths["flash"])
    paths["moe"] = fd.ffn.get("kind") == "moe"
    regime = routing_of(model, routing) if paths["moe"] else None
    stats = measure_routing(paths["flash"], paths["flash"].parent, routing_tokens) if paths["moe"] else None

    fio = fio_reference(fd.largest_unit_path, DEFAULT_THREADS)
    res = {
        "model": model,
        "paths": {k: str(v) for k, v in paths.items() if k not in ("prompt", "prompt_id", "moe")},
        "sampling": " ".join(map(str, sampling(paths))),
        "weight_bytes": weights,
        "flash_bytes": fd.model_bytes,
        "flash_down": down_storage(fd),
        "baseline_rss": baseline,
        "tokens": tokens,
        "timing": "one prompt token, then `tokens` decode steps; tok/s = steps / their time",
        "routing": regime if regime else ("model's own" if paths["moe"] else None),
        "routing_stats": stats,
        "rounds": rounds,
        "cap_factor": cap_factor,
        "fio": fio,
        "budgets": list(budgets),
        "prompt": paths["prompt"],
        "machine": machine_info(str(paths["flash"])),
        "versions": versions(),
        "runs": [],
        "resident_skipped": {},
    }
    for s in [s for s in systems if s in resident]:
        if not resident_fits(paths[SYSTEMS[s][1]], baseline):
            res["resident_skipped"][s] = "model + baseline do not fit in the memory available"
    # (system, budget %, cap); budget None: resident, no cap
    plan = [(s, b) for b in budgets for s in systems] + [
        (s, None) for s in systems if s in resident and s not in res["resident_skipped"]
    ]
    jobs = []
    for r in range(rounds):
        k = r % len(systems)
        order = [(s, b) for b in list(budgets) + [None] for s in systems[k:] + systems[:k] if (s, b) in plan]
        jobs += [(r, s, b, tokens) for s, b in order]
        if r == 0:  # the 1-step runs for bytes per step
            jobs += [(r, s, b, 1) for s, b in order]
    bar = tqdm(jobs, desc=f"peers {model}", unit="run", disable=not progress)
    retry = {}  # (system, budget %) -> the cap factor that first let an OOM-killed mlx_flash finish
    for rnd, system, pct, n in bar:
        budget, cap = budget_and_cap(pct, weights, baseline, cap_factor) if pct is not None else (None, None)
        bar.set_postfix_str(f"{system} @ {_label(pct)}")
        if system == "nunspark" and cap is not None:
            rec = _nunspark_run(paths, n, budget, cap, files, timeout, retry, pct, res["runs"])
        else:
            rec = run_one(
                system, paths, n, budget if budget is not None else weights, cap, files, timeout, resident=pct is None
            )
        rec.update(round=rnd, budget_pct=pct, budget=budget)
        if cap is not None and cap_factor != 1:
            rec["system"] = f"{system} (cap x{cap_factor:.2f})"
        res["runs"].append(rec)
        if log:
            bar.write(_describe(rec))
        if rec["oom"] and system.startswith("mlx_flash") and cap is not None:  # a number anyway, labelled
            rec2 = _retry(system, paths, n, budget, cap, files, timeout, retry, (system, pct))
            rec2.update(round=rnd, budget_pct=pct, budget=budget)
            res["runs"].append(rec2)
            if log:
                bar.write(_describe(rec2))
        if out:
            Path(out).write_text(json.dumps(dict(res, summary=summarize(res["runs"])), indent=2))
    # the disk's rate moves within minutes: its rate at the end too brackets what the run saw
    res["fio_end"] = fio_reference(fd.largest_unit_path, DEFAULT_THREADS) if fio else None
    res["summary"] = summarize(res["runs"])
    res["resident"] = resident_baselines(res["summary"])
    return res


def resident_baselines(summary) -> dict:
    """{system: its resident row}: the baselines the capped rows are compared with."""
    return {s: by["resident"] for s, by in summary.items() if "resident" in by}


def budget_and_cap(spec, weights: int, baseline: int, cap_factor: float = 1.0):
    """(budget, cap) in bytes for a budget given as a % of the weights (cap = budget + baseline) or as an
    absolute cap such as "2.5GiB" (budget = cap - baseline)."""
    if isinstance(spec, str):
        cap = int(parse_size(spec) * cap_factor)
        if cap <= baseline:
            raise ValueError(f"cap {spec} is below the Python baseline ({fmt_bytes(baseline)})")
        return cap - baseline, cap
    budget = int(weights * spec / 100)
    return budget, int((budget + baseline) * cap_factor)


def _nunspark_run(paths, tokens, budget, cap, files, timeout, tried, key, runs) -> dict:
    """nunspark under `cap` with the largest --budget (NUNSPARK_SHARE of `budget`, then 3/4 of that each
    time it is OOM-killed) that holds it; the budget that held is kept for later rounds. The killed
    attempts go into `runs` under their own label."""
    own = tried.get(("nunspark", key), int(budget * NUNSPARK_SHARE))
    for _ in range(MAX_RETRIES):
        rec = run_one("nunspark", paths, tokens, own, cap, files, timeout)
        rec["system_budget"] = own
        if not rec["oom"]:
            break
        runs.append(dict(rec, system="nunspark (OOM-killed at its budget)", budget_pct=key, budget=budget))
        own = int(own * NUNSPARK_BACKOFF)
    tried[("nunspark", key)] = own
    return rec


def _retry(system, paths, tokens, budget, cap, files, timeout, retry, key) -> dict:
    """Run an OOM-killed mlx_flash system again with its cap 25% larger, then larger again in 25%
    steps (at most MAX_RETRIES) until it finishes; the row is labelled with the factor. Later rounds
    start at the factor found first, so every round lands in the same row."""
    factor = retry.get(key, OOM_RETRY)
    for _ in range(MAX_RETRIES):
        rec = run_one(system, paths, tokens, budget, int(cap * factor), files, timeout)
        if not rec["oom"] or key in retry:
            break
        factor *= OOM_RETRY
    retry.setdefault(key, factor)
    rec["system"] = f"{system} (cap x{factor:.2f})"
    return rec


def merge(results) -> dict:
    """Results of several runs on the same model (e.g. budgets measured separately) as one."""
    res = dict(results[0], runs=[r for res in results for r in res["runs"]])
    res["budgets"] = sorted({b for r in results for b in r["budgets"]})
    res["rounds"] = max(r["rounds"] for r in results)
    res["summary"] = summarize(res["runs"])
    return res


def _describe(rec) -> str:
    status = "OOM" if rec["oom"] else f"{rec['tok_s']:.2f} tok/s" if rec["tok_s"] else f"exit {rec['returncode']}"
    if rec.get("step_ms_median"):
        status += f" (median step {rec['step_ms_median']:.0f} ms)"
    if rec.get("hit_rate") is not None:
        status += f", hit rate {rec['hit_rate']:.1%}"
    return (
        f"  {rec['system']} @ {_label(rec['budget_pct'])}, {rec['tokens']} steps: "
        f"{status}, read {fmt_bytes(rec['read_bytes'])}, peak RSS {fmt_bytes(rec['max_rss'])}, {rec['wall_s']:.0f} s"
    )


# -- summary, table, plot ------------------------------------------------------------------------------
def summarize(runs) -> dict:
    """{system: {budget label: {tok_s (median), step_ms_median, step_ms_mean, hit rates, bytes_per_token (a decode
    step's), max_rss, cgroup_peak, oom, runs}}}: medians over the runs."""
    out = {}
    groups = {}
    for r in runs:
        groups.setdefault((r["system"], r["budget_pct"]), []).append(r)
    for (system, pct), rs in groups.items():
        full = [r for r in rs if r["tokens"] > 1]
        short = [r for r in rs if r["tokens"] == 1 and r["returncode"] == 0]
        speeds = [r["tok_s"] for r in full if r["tok_s"]]
        s = {
            "runs": len(full),
            "oom": sum(r["oom"] for r in full),
            "tok_s": statistics.median(speeds) if speeds else None,
            "tok_s_all": speeds,
            "step_ms_median": _median([r.get("step_ms_median") for r in full if r["tok_s"]]),
            "step_ms_mean": _median([r.get("step_ms_mean") for r in full if r["tok_s"]]),
            "prompt_tokens": _median([r.get("prompt_tokens") for r in full if r["tok_s"]]),
            "steps": _median([r.get("generated") for r in full if r["tok_s"]]),
            **{
                k: _median([r.get(k) for r in full if r["tok_s"]])
                for k in ("hit_rate", "hit_rate_cold", "hit_rate_steady")
            },
            "max_rss": _median([r["max_rss"] for r in full]),
            "cgroup_peak": _median([r["cgroup_peak"] for r in full if r["cgroup_peak"]]),
            "bytes_per_token": None,
            "io_share": _median([r.get("io_share") for r in full if r["tok_s"]]),
            "read_bytes_per_s": _median([r.get("read_bytes_per_s") for r in full if r["tok_s"]]),
            "system_budget": _median([r.get("system_budget") for r in full if r["tok_s"]]),
        }
        ok = [r for r in full if r["tok_s"]]
        if ok and short and ok[0]["generated"] and ok[0]["generated"] > 1:
            per = [(r["read_bytes"] - short[0]["read_bytes"]) / (r["generated"] - 1) for r in ok]
            s["bytes_per_token"] = max(0.0, statistics.median(per))
        out.setdefault(system, {})[_label(pct)] = s
    return out


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _label(pct) -> str:
    return "resident" if pct is None else f"cap {pct}" if isinstance(pct, str) else f"{pct}%"


def ratios(summary, budgets) -> dict:
    """Per budget: mlx_flash dense, and the best mlx_flash row, over llama.cpp mmap (tokens/s). When
    mlx_flash was OOM-killed under the cap, its labelled run under the larger cap stands in (named)."""
    out = {}
    for b in map(_label, budgets):
        ref = summary.get("llama.cpp mmap", {}).get(b, {}).get("tok_s")
        flash = {s: v[b]["tok_s"] for s, v in summary.items() if s.startswith("mlx_flash") and b in v and v[b]["tok_s"]}
        dense = min((s for s in flash if s.startswith("mlx_flash dense")), key=len, default=None)
        best = max(flash, key=flash.get, default=None)
        ns = summary.get("nunspark", {}).get(b, {}).get("tok_s")
        resident = summary.get("llama.cpp", {}).get("resident", {}).get("tok_s")
        out[b] = {
            "dense": flash[dense] / ref if ref and dense else None,
            "dense_system": dense,
            "dense_llama_resident": flash[dense] / resident if resident and dense else None,
            "best": flash[best] / ref if ref and best else None,
            "best_system": best,
            "dense_nunspark": flash[dense] / ns if ns and dense else None,
        }
    return out


def table(res) -> str:
    budgets = [_label(b) for b in res["budgets"]] + ["resident", "no cap"]
    summary = res["summary"]
    budgets = [b for b in budgets if any(b in v for v in summary.values())]
    head = (
        "| system | "
        + " | ".join(f"{b} (cap {fmt_bytes(_cap(res, b))})" if b.endswith("%") else b for b in budgets)
        + " |"
    )
    rows = [head, "|---" * (len(budgets) + 1) + "|"]
    for system, by in summary.items():
        cells = []
        for b in budgets:
            s = by.get(b)
            if s is None:
                cells.append("")
                continue
            speed = ", ".join(
                ([f"**{s['tok_s']:.2f} tok/s**"] if s["tok_s"] else [] if s["oom"] else ["failed"])
                + ([f"OOM-killed {s['oom']}/{s['runs']}"] if s["oom"] else [])
            )
            if s.get("step_ms_median"):
                speed += f" (median step {s['step_ms_median']:.0f} ms)"
            bpt = [f"{fmt_bytes(s['bytes_per_token'])}/step"] if s["bytes_per_token"] is not None else []
            if s.get("hit_rate") is not None:
                bpt.append(
                    f"hit {s['hit_rate']:.0%}"
                    + (
                        f" (cold {s['hit_rate_cold']:.0%}, steady {s['hit_rate_steady']:.0%})"
                        if s.get("hit_rate_steady") is not None and s.get("hit_rate_cold") is not None
                        else ""
                    )
                )
            peak = f"RSS {fmt_bytes(s['max_rss'])}" + (
                f", cg {fmt_bytes(s['cgroup_peak'])}" if s["cgroup_peak"] else ""
            )
            io = [f"I/O wait {s['io_share']:.0%}"] if s.get("io_share") is not None else []
            if s.get("system_budget"):
                io.append(f"--budget {s['system_budget'] / 1e9:.2f} GB")
            if s.get("read_bytes_per_s"):
                fio = res.get("fio")
                io.append(
                    f"reads at {fmt_bytes(s['read_bytes_per_s'])}/s"
                    + (f" ({s['read_bytes_per_s'] / fio['bytes_per_s']:.0%} of fio)" if fio else "")
                )
            cells.append("; ".join([speed] + bpt + io + [peak]))
        rows.append(f"| {system} | " + " | ".join(cells) + " |")
    r = ratios(summary, res["budgets"])
    rows += [
        "",
        "| tok/s ratio | " + " | ".join(_label(b) for b in res["budgets"]) + " |",
        "|---" * (len(res["budgets"]) + 1) + "|",
        "| mlx_flash dense / llama.cpp mmap | "
        + " | ".join(
            _x(r[_label(b)]["dense"])
            + (
                f" ({r[_label(b)]['dense_system']})"
                if r[_label(b)]["dense_system"] not in (None, "mlx_flash dense")
                else ""
            )
            for b in res["budgets"]
        )
        + " |",
        "| best mlx_flash / llama.cpp mmap | "
        + " | ".join(
            _x(r[_label(b)]["best"]) + (f" ({r[_label(b)]['best_system']})" if r[_label(b)]["best"] else "")
            for b in res["budgets"]
        )
        + " |",
    ]
    if any(r[_label(b)].get("dense_llama_resident") for b in res["budgets"]):
        rows.append(
            "| mlx_flash dense / llama.cpp resident | "
            + " | ".join(_x(r[_label(b)].get("dense_llama_resident")) for b in res["budgets"])
            + " |"
        )
    if any(r[_label(b)]["dense_nunspark"] for b in res["budgets"]):
        rows.append(
            "| mlx_flash dense / nunspark | "
            + " | ".join(_x(r[_label(b)]["dense_nunspark"]) for b in res["budgets"])
            + " |"
        )
    return "\n".join(rows)


def _x(v) -> str:
    return f"{v:.2f}x" if v is not None else "-"


def _cap(res, label) -> int:
    spec = label[len("cap ") :] if label.startswith("cap ") else float(label[:-1])
    return budget_and_cap(spec, res["weight_bytes"], res["baseline_rss"], res.get("cap_factor", 1))[1]


def down_storage(fd) -> str:
    """How the flash directory stores down_proj per neuron, for the header."""
    if fd.ffn.get("kind") == "moe":
        return "experts as units, the source's codes"
    q = fd.ffn["matrices"][adapter_for(fd.config).col_matrix]["quantization"]
    if q is None:
        return "down_proj float"
    return "down_proj the source's codes" if q.get("resident_scales") else f"down_proj {q['bits']}-bit"


def header(res) -> str:
    m, v = res["machine"], res["versions"]
    return (
        f"model {res['model']}: weights {fmt_bytes(res['weight_bytes'])} (GGUF; flash directory "
        f"{fmt_bytes(res['flash_bytes'])}: {res.get('flash_down', 'down_proj 8-bit')}); "
        f"baseline (python + mlx_flash + mlx_lm + tokenizer peak RSS) "
        f"{fmt_bytes(res['baseline_rss'])}; cap = budget + baseline; "
        + (
            f"a prompt of one token, then {res['tokens']} decode steps (tok/s = steps / their time), "
            if res.get("timing")
            else f"{res['tokens']} tokens, "
        )
        + f"{res['rounds']} rounds"
        + (
            f"; Python systems sample {res['sampling']} (llama-bench: a random token each step)"
            if res.get("sampling", "--temp 0") != "--temp 0"
            else ""
        )
        + (
            f"\nrouting: {res['routing']}"
            + (f" ({describe_routing(res['routing_stats'])})" if res.get("routing_stats") else "")
            if res.get("routing")
            else ""
        )
        + "\n"
        f"machine: {m.get('cpu', '?')}, {m.get('cores')} cores, {m.get('ram_gib')} GiB, {m.get('filesystem', '?')}; "
        f"python {m['python']}, "
        + ", ".join(f"{k} {val}" for k, val in v.items())
        + (
            f"\nfio, same run: random O_DIRECT reads of {fmt_bytes(res['fio']['block'])} with {res['fio']['threads']} "
            f"threads on ffn.bin: {fmt_bytes(res['fio']['bytes_per_s'])}/s"
            + (f" at the start, {fmt_bytes(res['fio_end']['bytes_per_s'])}/s at the end" if res.get("fio_end") else "")
            if res.get("fio")
            else ""
        )
    )


def plot(res, out):
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4.2))
    budgets = res["budgets"]
    caps = [_cap(res, _label(b)) / 2**30 for b in budgets]  # x: the hard cap, the same for every system
    for system, by in res["summary"].items():
        ys = [by.get(_label(b), {}).get("tok_s") for b in budgets]
        oom = [c for b, c, y in zip(budgets, caps, ys) if not y and by.get(_label(b), {}).get("oom")]
        if any(ys):
            color = ax.plot(caps, [y if y else float("nan") for y in ys], marker="o", label=system)[0].get_color()
            if oom:
                ax.scatter(oom, [0] * len(oom), marker="x", color=color)
        else:
            color = ax.scatter(oom, [0] * len(oom), marker="x", label=f"{system} (OOM-killed)").get_facecolor()[0]
        nocap = by.get("resident", by.get("no cap", {})).get("tok_s")
        if nocap:
            ax.axhline(nocap, ls=":", color=color, lw=1)
            ax.annotate(f"{system}, resident", (min(caps), nocap), fontsize=7, color=color, va="bottom")
    ax.set_xlabel(f"hard memory cap, GiB (the weights: {res['weight_bytes'] / 2**30:.2f} GiB)")
    ax.set_ylabel("decode tokens/s (median)")
    ax.set_title(f"{res['model']}: tokens/s under a hard memory cap (x: OOM-killed, dotted: resident)", fontsize=9)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def setup_arg_parser():
    p = argparse.ArgumentParser(
        description="mlx_flash vs llama.cpp and mlx-lm on the same weights, under a hard memory cap."
    )
    p.add_argument(
        "--model",
        default="small",
        help="small (SmolLM2-135M Q4_1), a synthetic preset written as a random Q4_0 GGUF (llama-7b, "
        "qwen3-30b-a3b, moe-small) or a GGUF file.",
    )
    p.add_argument(
        "--budgets",
        default="25,50,80",
        help="Budgets in %% of the model's weight bytes (cap = budget + baseline), or hard caps as "
        "sizes (2.5GiB,1.9GiB: budget = cap - baseline).",
    )
    p.add_argument("--rounds", type=int, default=3, help="Rounds (each runs every system at every budget).")
    p.add_argument(
        "--tokens",
        type=int,
        default=None,
        help="Decode steps per run, after a one-token prompt (default 64; --quick 8).",
    )
    p.add_argument(
        "--routing",
        default="uniform",
        choices=ROUTINGS,
        help="Synthetic MoE presets: uniform (independent, the floor), skewed (Zipf-like) or own (sticky).",
    )
    p.add_argument(
        "--routing-tokens",
        type=int,
        default=64,
        help="Random tokens mlx_flash.tools.routing measures an MoE model's routing on (0: not measured).",
    )
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"Comma-separated subset of: {', '.join(SYSTEMS)}.")
    p.add_argument(
        "--resident",
        "--uncapped",
        dest="resident",
        default=",".join(RESIDENT),
        help="Systems also run with no cap and their model in the page cache (comma-separated; '' for none).",
    )
    p.add_argument("--timeout", type=float, default=1800, help="Seconds before a run is killed.")
    p.add_argument(
        "--cap-factor",
        type=float,
        default=1.0,
        help="Scale every cap by this (rows labelled), e.g. 1.25 where a system crawls under its cap.",
    )
    p.add_argument("--json", default=None, help="Write the results here.")
    p.add_argument("--plot", default=None, help="Write the tokens/s plot here (png).")
    p.add_argument(
        "--prompt",
        default=PROMPT,
        help="Its first token is every Python system's prompt (llama-bench warms up with one token).",
    )
    p.add_argument("--quick", action="store_true", help="One round of 8 decode steps.")
    p.add_argument(
        "--from-json",
        nargs="+",
        default=None,
        help="Summarise earlier --json results (e.g. one run per budget) instead of running.",
    )
    return p


def main(argv=None):
    a = setup_arg_parser().parse_args(argv)
    exit_on_sigterm()
    tokens = a.tokens or (8 if a.quick else 64)
    rounds = 1 if a.quick else a.rounds
    budgets = [b if re.search(r"[A-Za-z]", b) else float(b) if "." in b else int(b) for b in a.budgets.split(",") if b]
    systems = [s for s in a.systems.split(",") if s]
    bad = set(systems) - set(SYSTEMS)
    if bad:
        raise SystemExit(f"unknown systems {sorted(bad)} (choose from {', '.join(SYSTEMS)})")
    if a.from_json:
        res = merge([json.loads(Path(f).read_text()) for f in a.from_json])
    else:
        res = run(
            a.model,
            budgets,
            rounds,
            tokens,
            systems,
            a.timeout,
            log=True,
            resident=[s for s in a.resident.split(",") if s],
            out=a.json,
            cap_factor=a.cap_factor,
            prompt=a.prompt,
            routing=a.routing,
            routing_tokens=a.routing_tokens,
        )
    print(header(res))
    print(table(res))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))
    if a.plot:
        plot(res, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
