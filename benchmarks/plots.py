"""Every plot BENCHMARKS.md shows, redrawn from the JSON in benchmarks/results/ (and its tables, with --tables).

    python benchmarks/plots.py [--results benchmarks/results] [--out benchmarks/results] [--only dense,moe] [--tables]

One figure per question BENCHMARKS.md answers, each written as `fig_<question>.png`:

    dense        tokens/s of the LLaMA-7B shape under two hard caps against llama.cpp (mmap), and the ratio in every
                 run of that comparison against the disk's fio rate of the run
    moe          tokens/s of the Qwen3-30B-A3B shape by routing regime (uniform / the model's own / a skewed trace)
                 and cap, and the expert hit rate of the uniform-routing runs, cold start against steady state
    io           the native pread pool against fio at the same request size and thread count, and mlx_flash's reads
                 while in flight against the run's fio rate
    quality      perplexity increase and greedy agreement of the neuron selectors against the dense model
    speculation  what a verification pass costs against its width, and end-to-end speed-ups of prompt lookup and a
                 draft model
    memory       peak RSS and the memory cgroup's peak of every capped run against its cap (and budget)

Nothing is measured here: the script reads the results files the benchmark commands wrote (each figure names
them at its foot) and needs only matplotlib. `--tables` prints the markdown tables BENCHMARKS.md holds, computed
from the same files, so every figure there can be checked against its JSON.
"""

import argparse
import glob
import json
import os
import re
import statistics
import sys

GiB = 2**30
MiB = 2**20

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


# -- reading ---------------------------------------------------------------------------------------------------


class Results:
    """The results directory: JSON files by name, each read once."""

    def __init__(self, path: str):
        self.path = path
        self._cache = {}

    def __call__(self, name: str):
        if name not in self._cache:
            with open(os.path.join(self.path, name)) as f:
                self._cache[name] = json.load(f)
        return self._cache[name]

    def glob(self, pattern: str):
        return sorted(os.path.basename(p) for p in glob.glob(os.path.join(self.path, pattern)))


def cell(d, system: str, budget: str):
    """One system at one budget of a `peers` JSON (medians over its rounds), or None."""
    return d.get("summary", {}).get(system, {}).get(budget)


def machine_line(d) -> str:
    """Machine, versions and the disk's fio rate, as far as a results file records them."""
    m = d.get("machine") or {}
    if isinstance(m, str):
        m = {"platform": m}
    v = d.get("versions") or {}
    parts = []
    cpu = m.get("cpu")
    if cpu:
        cpu = cpu.replace("(R)", "").replace(" Processor", "")
        parts.append(f"{m.get('cores', '?')}-core {cpu} VM, {m.get('ram_gib', '?')} GiB")
    elif m.get("platform"):
        parts.append(m["platform"].split("-with")[0])
    if m.get("kernel"):
        parts.append(f"Linux {m['kernel']}")
    sw = []
    for k, name in (("python", "Python"), ("mlx", "mlx")):
        if m.get(k) or v.get(k):
            sw.append(f"{name} {m.get(k) or v.get(k)}")
    if v.get("mlx_lm"):
        sw.append(f"mlx-lm {v['mlx_lm']}")
    if v.get("llama.cpp"):
        lc = re.match(r"vendored in llama-cpp-python ([\w.]+): version: ([\w.-]+)", v["llama.cpp"])
        sw.append(
            f"llama.cpp {lc.group(2)} (llama-cpp-python {lc.group(1)} sdist)" if lc else f"llama.cpp {v['llama.cpp']}"
        )
    if sw:
        parts.append(", ".join(sw))
    fio = d.get("fio")
    if isinstance(fio, dict) and fio.get("bytes_per_s"):
        s = f"fio {fio['bytes_per_s'] / GiB:.2f}"
        end = d.get("fio_end")
        if isinstance(end, dict) and end.get("bytes_per_s"):
            s += f" (start) / {end['bytes_per_s'] / GiB:.2f} (end)"
        s += f" GiB/s ({fio.get('block', 0) // 1024} KiB random O_DIRECT reads, {fio.get('threads')} threads)"
        parts.append(s)
    return "; ".join(parts) if parts else "machine not recorded in the file"


def fmt(x, spec="{:.2f}", none="-"):
    return none if x is None else spec.format(x)


def span(xs, spec="{:.2f}"):
    lo, hi = spec.format(min(xs)), spec.format(max(xs))
    return lo if lo == hi else f"{lo}-{hi}"


def rounds(c, spec="{:.2f}"):
    return ", ".join(spec.format(t) for t in c.get("tok_s_all") or [])


# -- dense ------------------------------------------------------------------------------------------------------

SYM_7B = "peers_llama7b_caps_symmetric.json"
CAPS = ("cap 2.5GiB", "cap 1.9GiB")


def dense_runs(R):
    """Every 7B run of mlx_flash dense against llama.cpp mmap under the two caps: (file, cap, ratio, fio, symmetric)."""
    names = [
        "peers_llama7b_caps.json",
        "peers_llama7b_cap25_rerun.json",
        "peers_llama7b_cap25_rerun2.json",
        "peers_llama7b_caps_rerun3.json",
        "peers_llama7b_caps_v4.json",
    ]
    names += R.glob("peers_llama7b_caps_v4_run*.json") + [SYM_7B]
    out = []
    for n in names:
        if not os.path.exists(os.path.join(R.path, n)):
            continue
        d = R(n)
        fio = (d.get("fio") or {}).get("bytes_per_s")
        for cap in CAPS:
            a, b = cell(d, "mlx_flash dense", cap), cell(d, "llama.cpp mmap", cap)
            if a and b and a.get("tok_s") and b.get("tok_s"):
                out.append((n, cap, a["tok_s"] / b["tok_s"], fio / GiB if fio else None, "timing" in d))
    return out


def fig_dense(R, plt):
    d = R(SYM_7B)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.6))
    groups = [
        ("cap 2.5 GiB", "cap 2.5GiB"),
        ("cap 1.9 GiB", "cap 1.9GiB"),
        ("no cap\n(model in page cache)", "resident"),
    ]
    systems = [
        ("mlx_flash dense (lossless)", "mlx_flash dense", "tab:blue"),
        ("llama.cpp mmap", "llama.cpp mmap", "tab:gray"),
    ]
    w = 0.38
    for j, (label, key, color) in enumerate(systems):
        for i, (_, b) in enumerate(groups):
            c = cell(d, key, b) or (d.get("resident", {}).get(key) if b == "resident" else None)
            if not c or not c.get("tok_s"):
                continue
            x = i + (j - 0.5) * w if b != "resident" else i
            ax.bar(x, c["tok_s"], w, color=color, label=label if i == 0 else None)
            ax.plot([x + w * 0.3] * len(c["tok_s_all"]), c["tok_s_all"], "k.", ms=3)
            ax.annotate(f"{c['tok_s']:.2f}", (x, c["tok_s"]), ha="center", va="bottom", fontsize=8)
    for i, (_, b) in enumerate(groups[:2]):
        a, l_ = cell(d, "mlx_flash dense", b), cell(d, "llama.cpp mmap", b)
        ax.annotate(
            f"{a['tok_s'] / l_['tok_s']:.1f}x",
            (i, max(a["tok_s"], l_["tok_s"]) + 0.6),
            ha="center",
            fontsize=10,
            fontweight="bold",
        )
    ax.set_xticks(range(len(groups)), [g[0] for g in groups])
    ax.set_ylabel("tokens/s (median of 3 rounds; dots: rounds)")
    ax.set_title("LLaMA-7B shape, random Q4_0 (3.5 GiB GGUF), hard cap\n1 prompt token + 16 decode steps")
    ax.legend(loc="upper left", fontsize=8)

    runs = dense_runs(R)
    for cap, color in zip(CAPS, ("tab:blue", "tab:orange")):
        for sym, marker, fill in ((False, "o", "none"), (True, "*", color)):
            pts = [(f, r) for n, c, r, f, s in runs if c == cap and s == sym and f]
            if pts:
                label = f"{cap[4:].replace('GiB', ' GiB')}, " + (
                    "one prompt token + 16 steps" if sym else "8 tokens over 7 steps (up to 1.14x high)"
                )
                bx.scatter(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    marker=marker,
                    s=120 if sym else 30,
                    facecolors=fill,
                    edgecolors=color,
                    label=label,
                )
    bx.axhline(1.0, color="k", lw=0.6)
    bx.set_ylim(0, None)
    bx.set_xlabel("fio at the run's start, GiB/s (1 MiB random O_DIRECT reads, 32 threads)")
    bx.set_ylabel("mlx_flash dense / llama.cpp mmap, tokens/s")
    bx.set_title(f"every run of the comparison ({len({r[0] for r in runs})} runs)")
    bx.legend(fontsize=7, loc="lower right")
    return fig, [SYM_7B, "peers_llama7b_caps*.json", "peers_llama7b_cap25_rerun*.json"]


def table_dense(R):
    rows = [
        (
            "| model, weights | cap | mlx_flash tok/s (rounds) | llama.cpp tok/s (rounds) | mlx_flash / llama.cpp "
            "| mlx_flash read/token, I/O wait | file |"
        ),
        "|---|---|---|---|---|---|---|",
    ]
    d = R(SYM_7B)
    shape = "LLaMA-7B shape, random Q4_0, 3.5 GiB GGUF"
    for cap in CAPS:
        a, b = cell(d, "mlx_flash dense", cap), cell(d, "llama.cpp mmap", cap)
        rows.append(
            f"| {shape} | {cap[4:].replace('GiB', ' GiB')} | **{a['tok_s']:.2f}** ({rounds(a)}) "
            f"| mmap: {b['tok_s']:.2f} ({rounds(b)}) | **{a['tok_s'] / b['tok_s']:.2f}x** "
            f"| {a['bytes_per_token'] / GiB:.2f} GiB, {a['io_share'] * 100:.0f}% | `{SYM_7B}` |"
        )
    r = d["resident"]["llama.cpp mmap"]
    rows.append(
        f"| {shape} | none (model in the page cache) | - | mmap: {r['tok_s']:.2f} ({rounds(r)}) | - | - | `{SYM_7B}` |"
    )
    for n, model in (
        ("resident_decode_llama7b.json", shape),
        ("resident_decode_smollm2.json", "SmolLM2-135M-Instruct, Q4_1 GGUF (93.8 MiB)"),
    ):
        e = R(n)
        mf, lc = e["rounds"]["mlx_flash"], e["rounds"]["llama.cpp"]
        rows.append(
            f"| {model} | none, every weight resident | {e['median']['mlx_flash']:.2f} "
            f"({', '.join(f'{x:.2f}' for x in mf)}) | llama-bench defaults: {e['median']['llama.cpp']:.2f} "
            f"({', '.join(f'{x:.2f}' for x in lc)}) | {e['ratio']:.2f}x | 0 | `{n}` |"
        )
    s = R("peers_small_main.json")
    for b in ("25%", "50%", "80%"):
        a, m = cell(s, "mlx_flash dense", b), cell(s, "llama.cpp mmap", b)
        cap = a and next(r["cap"] for r in s["runs"] if r.get("budget_pct") == int(b[:-1]))
        rows.append(
            f"| SmolLM2-135M-Instruct, Q4_1 GGUF (93.8 MiB) | {b} + baseline ({cap / MiB:.0f} MiB) "
            f"| {a['tok_s']:.2f} (1 round) | mmap: {m['tok_s']:.1f} (1 round) | {a['tok_s'] / m['tok_s']:.2f}x "
            f"| {a['bytes_per_token'] / MiB:.0f} MiB, - | `peers_small_main.json` |"
        )
    return "\n".join(rows)


# -- mixture of experts ------------------------------------------------------------------------------------------

UNI = "peers_qwen3_30b_uniform.json"
UNI_RES = "peers_qwen3_30b_uniform_resident.json"
OWN = "peers_qwen3_30b_v4.json"
SKEW = "moe_decode_qwen3_30b.json"


def moe_points(R):
    """(routing, budget, mlx_flash tok/s, hit rate, llama.cpp mmap tok/s, nunspark tok/s, file)."""
    pts = []
    u = R(UNI)
    for b in ("25%", "50%"):
        a, l_, n = cell(u, "mlx_flash dense", b), cell(u, "llama.cpp mmap", b), cell(u, "nunspark", b)
        pts.append(("uniform", b, a["tok_s"], a["hit_rate"], l_["tok_s"], n and n["tok_s"], UNI))
    o, s = R(OWN), R(SKEW)
    own_hits = {r["budget"]: r["hit_rate"] for r in s["runs"] if r["routing"] == "model"}
    for b in ("25%", "50%"):
        a, l_ = cell(o, "mlx_flash dense", b), cell(o, "llama.cpp mmap", b)
        pts.append(("the model's own", b, a["tok_s"], own_hits.get(b), l_["tok_s"], None, OWN))
    for r in s["runs"]:
        if r["routing"] == "skewed" and r["budget"] != "none":
            pts.append(("skewed trace", r["budget"], r["tok_s"], r["hit_rate"], None, None, SKEW))
    return pts


def fig_moe(R, plt):
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.6))
    pts = moe_points(R)
    w = 0.27
    for i, (routing, b, tok, hit, lc, nun, _) in enumerate(pts):
        for j, (v, color, label) in enumerate(
            ((tok, "tab:blue", "mlx_flash"), (lc, "tab:gray", "llama.cpp mmap"), (nun, "tab:green", "nunspark 0.13"))
        ):
            if v is None:
                continue
            x = i + (j - 1) * w
            ax.bar(x, v, w, color=color, label=label if label not in ax.get_legend_handles_labels()[1] else None)
            ax.annotate(f"{v:.2f}", (x, v), ha="center", va="bottom", fontsize=7)
        if hit is not None:
            ax.annotate(f"hits {hit * 100:.0f}%", (i - w, tok * 1.8), ha="center", fontsize=7, color="tab:blue")
    timing = {UNI: "1 + 16 steps", OWN: "8 tokens / 7 steps", SKEW: "no cap, 64 tokens"}
    ax.set_xticks(
        range(len(pts)),
        [f"{p[0]}\n{'cap' if p[6] != SKEW else 'budget'} {p[1]}\n({timing[p[6]]})" for p in pts],
        fontsize=6,
    )
    ax.set_yscale("log")
    ax.set_ylim(0.05, 30)
    ax.set_ylabel("tokens/s (median)")
    ax.set_title("Qwen3-30B-A3B shape, random Q4_0 (16 GiB GGUF)\nhard cap = % of the GGUF + baseline")
    ax.legend(fontsize=8, loc="upper left")

    # cold start against steady state, all from the uniform-routing runs (one code, one machine)
    u, z = R(UNI), R(UNI_RES)
    lru = u["routing_stats"]["lru"]
    groups = [
        ("cap 25%", cell(u, "mlx_flash dense", "25%"), lru.get("0.25")),
        ("cap 50%", cell(u, "mlx_flash dense", "50%"), lru.get("0.5")),
        ("budget 100%\n(no cap)", cell(z, "mlx_flash dense", "resident"), None),
    ]
    w = 0.2
    kinds = (
        ("hit_rate", "all 16 steps", "tab:blue"),
        ("hit_rate_cold", "until the caches fill", "tab:cyan"),
        ("hit_rate_steady", "after (steady state)", "tab:purple"),
    )
    for i, (_, c, sim) in enumerate(groups):
        for j, (key, label, color) in enumerate(kinds):
            v = c.get(key)
            if v is None:
                continue
            x = i + (j - 1.5) * w
            bx.bar(x, v * 100, w, color=color, label=label if i == 0 else None)
            bx.annotate(f"{v * 100:.0f}", (x, v * 100), ha="center", va="bottom", fontsize=7)
        if sim:
            x = i + 1.5 * w
            bx.bar(
                x,
                sim["steady"] * 100,
                w,
                color="tab:gray",
                label="LRU simulation of the routing, steady" if i == 0 else None,
            )
            bx.annotate(f"{sim['steady'] * 100:.0f}", (x, sim["steady"] * 100), ha="center", va="bottom", fontsize=7)
    bx.set_xticks(range(len(groups)), [g[0] for g in groups])
    bx.set_ylim(0, 100)
    bx.set_ylabel("share of a token's experts found cached, %")
    bx.set_title("uniform routing: expert hit rate, cold start against steady state")
    bx.legend(fontsize=7, loc="upper left")
    return fig, [UNI, UNI_RES, OWN, SKEW]


def table_moe(R):
    rows = [
        (
            "| routing (hit rate of the expert caches) | cap | mlx_flash tok/s (rounds) "
            "| mlx_flash read/token, I/O wait | llama.cpp mmap tok/s | nunspark 0.13 tok/s "
            "| mlx_flash / llama.cpp mmap | timing | file |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    u = R(UNI)
    for b in ("25%", "50%"):
        a, l_, n = cell(u, "mlx_flash dense", b), cell(u, "llama.cpp mmap", b), cell(u, "nunspark", b)
        cap = next(r["cap"] for r in u["runs"] if r.get("budget_pct") == int(b[:-1]))
        rows.append(
            f"| uniform ({a['hit_rate'] * 100:.0f}%: cold start {a['hit_rate_cold'] * 100:.0f}%, steady "
            f"{a['hit_rate_steady'] * 100:.0f}%) | {b} ({cap / GiB:.1f} GiB) | **{a['tok_s']:.2f}** ({rounds(a)}) "
            f"| {a['bytes_per_token'] / MiB:.0f} MiB, {a['io_share'] * 100:.0f}% | {l_['tok_s']:.2f} "
            f"| {n['tok_s']:.2f} | **{a['tok_s'] / l_['tok_s']:.1f}x** | 1 prompt token + 16 steps | `{UNI}` |"
        )
    o, s = R(OWN), R(SKEW)
    hits = {r["budget"]: r["hit_rate"] for r in s["runs"] if r["routing"] == "model"}
    for b in ("25%", "50%"):
        a, l_ = cell(o, "mlx_flash dense", b), cell(o, "llama.cpp mmap", b)
        cap = next(r["cap"] for r in o["runs"] if r.get("budget_pct") == int(b[:-1]))
        rows.append(
            f"| the model's own (sticky: {hits[b] * 100:.0f}% in `{SKEW}`) | {b} ({cap / GiB:.1f} GiB) "
            f"| {a['tok_s']:.2f} ({rounds(a)}) | {a['bytes_per_token'] / MiB:.0f} MiB, {a['io_share'] * 100:.0f}% "
            f"| {l_['tok_s']:.2f} | - | {a['tok_s'] / l_['tok_s']:.1f}x | 8 tokens over 7 steps | `{OWN}` |"
        )
    for r in s["runs"]:
        if r["routing"] == "skewed" and r["budget"] != "none":
            rows.append(
                f"| skewed trace, replayed ({r['hit_rate'] * 100:.0f}%) | {r['budget']} (budget, no cap) "
                f"| {r['tok_s']:.2f} (1 run) | {r['bytes_per_token'] / MiB:.0f} MiB, "
                f"{r['io_ms'] / r['token_ms'] * 100:.0f}% | - | - | - | 64 forced tokens | `{SKEW}` |"
            )
    z = R(UNI_RES)["summary"]
    a, lc, ml = z["mlx_flash dense"]["resident"], z["llama.cpp"]["resident"], z["mlx-lm"]["resident"]
    lm = u["resident"]["llama.cpp mmap"]
    rows.append(
        f"| uniform (caches start empty: {a['hit_rate'] * 100:.0f}%) | none (budget 100%) | {a['tok_s']:.2f} "
        f"({rounds(a)}) | {a['bytes_per_token'] / MiB:.0f} MiB, {a['io_share'] * 100:.0f}% | {lm['tok_s']:.2f}; "
        f"defaults {lc['tok_s']:.2f}; stock mlx-lm {ml['tok_s']:.2f} | - | {a['tok_s'] / lm['tok_s']:.2f}x "
        f"| 1 prompt token + 16 steps | `{UNI_RES}`, `{UNI}` |"
    )
    return "\n".join(rows)


# -- the I/O engine -----------------------------------------------------------------------------------------------


def io_points(R):
    """(file, config, mean request bytes, pool GB/s, fio GB/s) where a bench run measured both at one size."""
    out = []
    for n in R.glob("bench_*.json"):
        d = R(n)
        configs = d.get("configs")
        if not isinstance(configs, dict):
            continue
        for k, c in configs.items():
            if isinstance(c, dict) and c.get("disk_gbps") and c.get("fio_gbps") and c.get("mean_request_bytes"):
                out.append((n, k, c["mean_request_bytes"], c["disk_gbps"], c["fio_gbps"]))
    return out


def inflight_points(R):
    """(file, budget, mlx_flash's read rate while in flight GiB/s, fio GiB/s at the run's start) of capped runs."""
    out = []
    for n in R.glob("peers_*.json"):
        d = R(n)
        fio = (d.get("fio") or {}).get("bytes_per_s")
        for b, c in (d.get("summary", {}).get("mlx_flash dense") or {}).items():
            if fio and c.get("read_bytes_per_s") and b != "resident":
                out.append((n, b, c["read_bytes_per_s"] / GiB, fio / GiB))
    return out


SIZE_CLASSES = (
    (0, 1024, "512 B (a neuron's matrix alone)"),
    (1024, 8192, "3 KiB"),
    (8192, 64 * 1024, "14-36 KiB (scattered units, gaps filled)"),
    (64 * 1024, 4 * MiB, "0.7-1 MiB (dense layer runs)"),
)


def fig_io(R, plt):
    import matplotlib.colors as mcolors

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.6))
    pts = io_points(R)
    sc = ax.scatter(
        [p[4] for p in pts], [p[3] for p in pts], c=[p[2] for p in pts], cmap="viridis", norm=mcolors.LogNorm(), s=40
    )
    fig.colorbar(sc, ax=ax, label="mean request, bytes")
    lim = max(max(p[3] for p in pts), max(p[4] for p in pts)) * 1.15
    ax.plot([0, lim], [0, lim], "k--", lw=0.7, label="pool = fio")
    ax.set_xlim(0, lim)
    ax.set_ylim(0, lim)
    ax.set_xlabel("fio, GB/s (psync, O_DIRECT, random, same size and threads)")
    ax.set_ylabel("native pread pool, GB/s")
    ax.set_title(f"the pool against fio on the same file, same run ({len(pts)} points)")
    ax.legend(fontsize=8, loc="upper left")

    inf = inflight_points(R)
    ax2 = [p for p in inf if "qwen3" in p[0]], [p for p in inf if "qwen3" not in p[0]]
    for sel, label, marker in ((ax2[0], "MoE (2.5 MiB experts)", "s"), (ax2[1], "dense (1 MiB requests)", "o")):
        bx.scatter([p[3] for p in sel], [p[2] for p in sel], marker=marker, s=30, label=label)
    lim = max(max(p[2] for p in inf), max(p[3] for p in inf)) * 1.15
    bx.plot([0, lim], [0, lim], "k--", lw=0.7, label="= fio")
    bx.set_xlim(0, lim)
    bx.set_ylim(0, lim)
    bx.set_xlabel("fio at the run's start, GiB/s (1 MiB, 32 threads)")
    bx.set_ylabel("mlx_flash's reads while in flight, GiB/s")
    bx.set_title(f"whole runs under a hard cap ({len(inf)} run x cap medians)")
    bx.legend(fontsize=8, loc="upper left")
    return fig, ["bench_*.json", "peers_*.json"]


def table_io(R):
    rows = [
        (
            "| request size (runtime configurations) | points | native pool, GB/s | fio, GB/s "
            "| pool / fio: median (range) | files |"
        ),
        "|---|---|---|---|---|---|",
    ]
    pts = io_points(R)
    for lo, hi, label in SIZE_CLASSES:
        sel = [p for p in pts if lo <= p[2] < hi]
        if not sel:
            continue
        r = [p[3] / p[4] for p in sel]
        files = sorted({p[0] for p in sel})
        rows.append(
            f"| {label} | {len(sel)} | {span([p[3] for p in sel])} | {span([p[4] for p in sel])} "
            f"| {statistics.median(r):.2f}{f' ({span(r)})' if len(r) > 1 else ''} "
            f"| {', '.join(f'`{f}`' for f in files)} |"
        )
    inf = inflight_points(R)
    r = [p[2] / p[3] for p in inf]
    rows.append(
        f"| whole runs under a cap: mlx_flash's reads while in flight (experts 2.5 MiB, dense 1 MiB) against "
        f"fio at 1 MiB, GiB/s | {len(inf)} | {min(p[2] for p in inf):.1f}-{max(p[2] for p in inf):.1f} "
        f"| {min(p[3] for p in inf):.1f}-{max(p[3] for p in inf):.1f} | {statistics.median(r):.2f} "
        f"({min(r):.2f}-{max(r):.2f}) | `peers_*.json` ({len({p[0] for p in inf})} files) |"
    )
    return "\n".join(rows)


# -- quality ------------------------------------------------------------------------------------------------------

SEL = "selectors_smollm2.json"


def fig_quality(R, plt):
    d = R(SEL)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.6))
    names = []
    for r in d["rows"]:
        if r["selector"] not in names and r["selector"] != "dense":
            names.append(r["selector"])
    for name in names:
        rs = sorted((r for r in d["rows"] if r["selector"] == name), key=lambda r: r["density"])
        style = "--" if name in ("oracle",) else "-"
        ax.plot([r["density"] for r in rs], [r["ppl_increase"] * 100 for r in rs], style, marker="o", label=name)
        bx.plot([r["density"] for r in rs], [r["agreement"] * 100 for r in rs], style, marker="o", label=name)
    ax.set_yscale("log")
    ax.set_xlabel("MLP density (share of the FFN's neurons a token uses)")
    ax.set_ylabel("perplexity increase over dense, %")
    ax.set_title(f"SmolLM2-135M, {d['held_out_tokens']} held-out WikiText-2 tokens (dense {d['dense_ppl']:.2f})")
    ax.legend(fontsize=7)
    bx.set_xlabel("MLP density")
    bx.set_ylabel("greedy agreement with the dense model, %")
    bx.set_title("the dense model's greedy tokens, teacher-forced")
    bx.set_ylim(0, 100)
    return fig, [SEL]


def table_quality(R):
    rows = ["| check | model | result | file |", "|---|---|---|---|"]
    for n, model in (
        ("ab_same_bits_smollm2.json", "SmolLM2-135M (default model)"),
        ("ab_same_bits_7b_wide.json", "LLaMA-7B-wide shape, 2 layers, random weights"),
    ):
        d = R(n)
        budgets = list(d["summary"].keys())
        budgets = [b for b in budgets if not b.startswith(("before", "after"))]
        texts = {r["text"] for b in budgets for r in d["runs"][b]["after"]}
        rows.append(
            f"| one text at every budget, `--sparsity dense` ({', '.join(budgets)}; 3 rounds each) | {model} "
            f"| {'yes' if d['summary']['after: one text at every budget'] else 'no'}: {len(texts)} distinct "
            f"text over {sum(len(d['runs'][b]['after']) for b in budgets)} runs | `{n}` |"
        )
    d = R("lossless_llama7b_default.json")
    rows.append(
        f"| streamed at {d['budget'] / MiB:.0f} MiB against every weight resident, "
        f"{len(d['streamed'])} greedy tokens | LLaMA-7B shape, random Q4_0 | "
        f"{'identical tokens' if d['identical'] else 'tokens differ'}; log-probabilities within "
        f"{d['max_abs_logprob_diff']:.1e} | `lossless_llama7b_default.json` |"
    )
    p = R("ppl_check_smollm2.json")
    ref = next(r for r in p["rows"] if r["system"] == "llama-perplexity")
    for r in p["rows"]:
        if r["system"] == "mlx_flash resident":
            rows.append(
                f"| perplexity against llama.cpp's `llama-perplexity` ({p['chunks']} chunks of {p['ctx']}, "
                f"held-out WikiText-2, same token ids) | SmolLM2-135M, Q4_1 GGUF | {r['ppl']:.3f} against "
                f"{ref['ppl']:.3f} ({r['rel_diff'] * 100:+.2f}%); KL {r['kld']:.4f} a token; same argmax "
                f"{r['top1_agreement'] * 100:.1f}% | `ppl_check_smollm2.json` |"
            )
    m = R("moe_gguf_check.json")["runs"]
    diffs = [r["rel_diff"] for v in m.values() for r in v["rows"] if "rel_diff" in r]
    agree = [r["top1_agreement"] for v in m.values() for r in v["rows"] if "top1_agreement" in r]
    rows.append(
        f"| perplexity against `llama-perplexity`, one tiny random-Q4_0 GGUF per MoE architecture "
        f"({', '.join(m)}) | 2 layers, 8 experts | within {max(abs(x) for x in diffs) * 100:.2f}%; same argmax "
        f"{min(agree) * 100:.1f}-{max(agree) * 100:.1f}% (random weights: near-ties) | `moe_gguf_check.json` |"
    )
    q = R("int8_quality_smollm2.json")
    pre = q["greedy_agreeing_prefix"]
    rows.append(
        f"| int8 activations (the CPU default) against float32 (`generate --exact`), {q['windows']} windows of "
        f"{q['tokens']} tokens fed one a step | SmolLM2-135M | perplexity {q['int8']['perplexity']:.2f} against "
        f"{q['float32']['perplexity']:.2f} ({q['perplexity_increase'] * 100:+.2f}%); same argmax "
        f"{q['argmax_agreement'] * 100:.1f}%; greedy text equal for {pre.count(max(pre))} of {len(pre)} prompts "
        f"over all {max(pre)} tokens (the others: {', '.join(str(x) for x in sorted(x for x in pre if x < max(pre)))}) "
        f"| `int8_quality_smollm2.json` |"
    )
    d = R(SEL)
    for name in ("oracle", "sketch-4b", "sketch-3b"):
        r = next(r for r in d["rows"] if r["selector"] == name and r["density"] == 0.5)
        rows.append(
            f"| sparse selector `{name}` at MLP density 0.5 against the dense model | SmolLM2-135M | perplexity "
            f"{r['ppl_increase'] * 100:+.1f}%; greedy agreement {r['agreement'] * 100:.1f}%; "
            f"{r['dram_bytes'] / MiB:.1f} MiB of DRAM | `{SEL}` |"
        )
    return "\n".join(rows)


# -- speculation --------------------------------------------------------------------------------------------------

SPEC_7B, SPEC_30B = "spec_passes_llama7b.json", "spec_passes_qwen3_30b.json"
SPEC_RUNS = (
    ("prompt_lookup_smollm2.json", "SmolLM2-135M, 50%"),
    ("draft_model_smollm2.json", "SmolLM2-135M, 150%"),
    ("prompt_lookup_llama7b.json", "LLaMA-7B shape, 50% (random weights)"),
)


def pass_costs(d):
    """{width: (ms x one, device bytes x one)} from a spec_passes JSON: medians over rounds and repeats."""
    by = {}
    for r in d["runs"]:
        for p in r["passes"]:
            by.setdefault(p["width"], []).append(p)
    t1 = d["cost_ms"]["1"]
    b1 = statistics.median(p["bytes"] for p in by[1])
    return {
        w: (d["cost_ms"][str(w)] / t1, statistics.median(p["bytes"] for p in ps) / b1 if b1 else None)
        for w, ps in sorted(by.items())
    }


def spec_rows(R):
    """(model, task, mode, median tok/s, speed-up, accepted share, tokens a pass, text == plain's, file)."""
    out = []
    for n, model in SPEC_RUNS:
        d = R(n)
        tasks = []
        for r in d["runs"]:
            if r["task"] not in tasks:
                tasks.append(r["task"])
        for t in tasks:
            runs = [r for r in d["runs"] if r["task"] == t]
            plain = [r for r in runs if r["mode"] == "plain"]
            base = statistics.median(r["tps"] for r in plain)
            modes = []
            for r in runs:
                if r["mode"] not in modes:
                    modes.append(r["mode"])
            for mode in modes:
                rs = [r for r in runs if r["mode"] == mode]
                tps = statistics.median(r["tps"] for r in rs)
                acc = sum(r.get("accepted", 0) for r in rs) / max(1, sum(r.get("drafted", 0) for r in rs))
                same = all(r["text"] == p["text"] for r in rs for p in plain if p["round"] == r["round"])
                out.append(
                    (
                        model,
                        t,
                        mode,
                        [r["tps"] for r in rs],
                        tps,
                        tps / base,
                        None if mode == "plain" else acc,
                        statistics.median(r.get("mean_accepted_length", 1.0) for r in rs),
                        same,
                        n,
                    )
                )
    return out


def fig_speculation(R, plt):
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.6))
    for n, label, color in (
        (SPEC_7B, "LLaMA-7B shape, 50%, dense", "tab:blue"),
        (SPEC_30B, "Qwen3-30B-A3B shape, 25%, experts", "tab:red"),
    ):
        c = pass_costs(R(n))
        ws = list(c)
        ax.plot(ws, [c[w][0] for w in ws], "-o", color=color, label=f"{label}: time")
        if n == SPEC_7B:
            ax.plot(ws, [c[w][1] for w in ws], ":s", color=color, label=f"{label}: device bytes")
    ax.plot([1, 32], [1, 32], "k--", lw=0.6, label="width x one position")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ticks = [1, 2, 4, 8, 16, 32]
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_yticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("positions in the pass (k drafts + 1)")
    ax.set_ylabel("x a one-position pass")
    ax.set_title("what a verification pass costs against its width\n(hard cap; medians of the rounds' passes)")
    ax.legend(fontsize=7)

    rows = [r for r in spec_rows(R) if r[2] != "plain"]
    labels = [f"{r[1]}\n{r[2]}\n{r[0].split(' (')[0].replace('-135M', '').replace(' shape', '')}" for r in rows]
    colors = ["tab:green" if r[2] == "prompt-lookup" else "tab:purple" for r in rows]
    bx.bar(range(len(rows)), [r[5] for r in rows], color=colors)
    for i, r in enumerate(rows):
        bx.annotate(f"{r[5]:.2f}x\n{r[7]:.1f}/pass", (i, r[5]), ha="center", va="bottom", fontsize=7)
    bx.axhline(1.0, color="k", lw=0.7)
    bx.set_ylim(0, max(r[5] for r in rows) * 1.2)
    bx.set_xticks(range(len(rows)), labels, fontsize=6)
    bx.set_ylabel("generation tokens/s against plain decoding (medians)")
    bx.set_title("end to end, greedy (green: prompt lookup, purple: draft model)")
    return fig, [SPEC_7B, SPEC_30B] + [n for n, _ in SPEC_RUNS]


def table_speculation(R):
    rows = [
        (
            "| model, budget | task | mode | generation tok/s (rounds) | speed-up (medians) | drafts accepted "
            "| tokens a pass | text = plain's | file |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for model, task, mode, all_, tps, up, acc, tpp, same, n in spec_rows(R):
        rows.append(
            f"| {model} | {task} | {mode} | {', '.join(f'{x:.1f}' for x in all_)} | "
            f"{'**' if mode != 'plain' else ''}{up:.2f}x{'**' if mode != 'plain' else ''} "
            f"| {fmt(acc, '{:.0%}')} | {tpp:.2f} | {'-' if mode == 'plain' else ('yes' if same else 'no')} "
            f"| `{n}` |"
        )
    return "\n".join(rows)


# -- memory -------------------------------------------------------------------------------------------------------


def memory_points(R):
    """(model, system, cap label, cap, peak RSS, RSS reference, cgroup peak, OOM kills, runs, file) of capped runs.

    A `peers` run's peak RSS is the child's whole resident set (wait4), against the cap; a verification-pass run
    records the process's peak above its baseline, against the budget (cap = budget + baseline)."""
    out = []
    for n, model in ((UNI, "Qwen3-30B-A3B shape (16 GiB GGUF)"), (SYM_7B, "LLaMA-7B shape (3.5 GiB GGUF)")):
        d = R(n)
        for system, by in d["summary"].items():
            for b, c in by.items():
                if b == "resident":
                    continue
                pct = int(b[:-1]) if b.endswith("%") else None
                caps = [
                    r["cap"]
                    for r in d["runs"]
                    if r["system"] == system
                    and r.get("cap")
                    and (r.get("budget_pct") == pct if pct is not None else f"cap {r.get('budget_pct')}" == b)
                ]
                cap = max(caps)
                label = b.replace("GiB", " GiB") if b.startswith("cap") else f"{b} + baseline"
                out.append((model, system, label, cap, c["max_rss"], cap, c["cgroup_peak"], c["oom"], c["runs"], n))
    for n, model in ((SPEC_7B, "LLaMA-7B shape"), (SPEC_30B, "Qwen3-30B-A3B shape")):
        d = R(n)
        out.append(
            (
                model,
                "mlx_flash, verification passes",
                ("50%" if "llama" in n else "25%") + " + baseline",
                d["cap"],
                max(r["peak_rss"] for r in d["runs"]),
                d["budget"],
                max(r["cgroup_peak"] for r in d["runs"]),
                0,
                len(d["runs"]),
                n,
            )
        )
    return out


def fig_memory(R, plt):
    pts = memory_points(R)
    fig, ax = plt.subplots(figsize=(12, 0.42 * len(pts) + 1.4))
    h = 0.38
    budget_labelled = False
    for i, p in enumerate(pts):
        y = len(pts) - 1 - i
        rss_label = "peak RSS (verification passes: above the baseline)" if i == 0 else None
        ax.barh(y + h / 2, p[4] / GiB, h, color="tab:blue", label=rss_label)
        ax.barh(
            y - h / 2,
            p[6] / GiB,
            h,
            color="tab:gray",
            label="memory cgroup's peak (RSS + page cache)" if i == 0 else None,
        )
        ax.plot([p[3] / GiB] * 2, [y - 0.45, y + 0.45], "k-", lw=2, label="the hard cap" if i == 0 else None)
        if p[5] != p[3]:
            label = None if budget_labelled else "the budget (cap - baseline)"
            ax.plot([p[5] / GiB] * 2, [y - 0.45, y + 0.45], "r:", lw=2, label=label)
            budget_labelled = True
        ax.annotate(
            f"{p[4] / GiB:.2f}",
            (p[4] / GiB, y + h / 2),
            va="center",
            fontsize=7,
            xytext=(3, 0),
            textcoords="offset points",
        )
    ax.set_yticks(
        range(len(pts)),
        [f"{p[0].split(' (')[0].replace(' shape', '')}, {p[2]}: {p[1]}" for p in reversed(pts)],
        fontsize=7,
    )
    ax.set_xlabel("GiB")
    ax.set_title(
        f"peak memory of every capped run (a memory cgroup with a hard limit; OOM kills: "
        f"{sum(p[7] for p in pts)} of {sum(p[8] for p in pts)} runs)"
    )
    ax.legend(fontsize=7, loc="lower right")
    return fig, sorted({p[-1] for p in pts})


def table_memory(R):
    rows = [
        "| model | system | cap | peak RSS | memory cgroup's peak | OOM-killed | file |",
        "|---|---|---|---|---|---|---|",
    ]
    for model, system, label, cap, rss, ref, cg, oom, runs, n in memory_points(R):
        rss_s = (
            f"{rss / GiB:.2f} GiB" if ref == cap else f"{rss / GiB:.2f} GiB above the baseline (budget {ref / GiB:.2f})"
        )
        rows.append(
            f"| {model} | {system} | {label} = {cap / GiB:.2f} GiB | {rss_s} | {cg / GiB:.2f} GiB "
            f"| {oom} of {runs} | `{n}` |"
        )
    return "\n".join(rows)


# -- main ---------------------------------------------------------------------------------------------------------

FIGURES = {
    "dense": (fig_dense, table_dense, [SYM_7B]),
    "moe": (fig_moe, table_moe, [UNI, OWN, SKEW]),
    "io": (fig_io, table_io, ["bench_synthetic_llama7b.json", UNI]),
    "quality": (fig_quality, table_quality, ["ppl_check_smollm2.json"]),
    "speculation": (fig_speculation, table_speculation, [SPEC_7B]),
    "memory": (fig_memory, table_memory, [UNI, SYM_7B]),
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default=RESULTS, help="Directory of the results JSON (default: benchmarks/results).")
    p.add_argument("--out", default=None, help="Where the PNGs go (default: the results directory).")
    p.add_argument("--only", default=None, help=f"Comma-separated subset of: {', '.join(FIGURES)}.")
    p.add_argument("--tables", action="store_true", help="Print BENCHMARKS.md's tables (markdown) instead of plotting.")
    p.add_argument("--dpi", type=int, default=110)
    args = p.parse_args(argv)

    names = args.only.split(",") if args.only else list(FIGURES)
    unknown = [n for n in names if n not in FIGURES]
    if unknown:
        p.error(f"unknown figure(s): {', '.join(unknown)}; choose from {', '.join(FIGURES)}")
    R = Results(args.results)

    if args.tables:
        for n in names:
            _, table, machine_of = FIGURES[n]
            print(f"## {n}\n")
            print(table(R))
            for m in machine_of:
                print(f"\n`{m}`: {machine_line(R(m))}")
            print()
        return 0

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("benchmarks/plots.py needs matplotlib: pip install '.[plot]'")
    out = args.out or args.results
    os.makedirs(out, exist_ok=True)
    for n in names:
        fig, sources = FIGURES[n][0](R, plt)
        fig.text(
            0.01,
            0.005,
            "from benchmarks/results/: " + ", ".join(sources) + "  (python benchmarks/plots.py)",
            fontsize=6,
            color="0.4",
        )
        fig.tight_layout(rect=(0, 0.03, 1, 1))
        path = os.path.join(out, f"fig_{n}.png")
        fig.savefig(path, dpi=args.dpi)
        plt.close(fig)
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
