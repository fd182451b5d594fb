"""Estimate tokens/s of the flash runtime on other machines from a trace (DIP, appendix A style).

    python -m mlx_flash.tools.simulate --bench bench.json [--trace trace.npz] [--machines this,m1-max,phone]

For each configuration of a `mlx_flash.bench` run (same model shape, budget plan, window) and each
machine, per layer and token:

1. cache simulation: the trace's active set (mapped onto the model as the bench did) against a
   window-k cache of the planned capacity (the runtime's policy: drop units not active in the last k
   tokens, evict the least recently active if still full, overflow what does not fit) -> units read;
   dense configurations read every unit not cached, no-cache ones every active unit;
2. flash time = bytes / flash_bandwidth(mean request size); requests: bundled units merge with
   neighbours closer than the reader's max gap (the gap is read too, as the pread pool does);
   unbundled: one request per matrix per run of neighbouring units; dense streaming: 1 MiB sequential requests;
3. DRAM time = (resident bytes + bytes of the units used) / DRAM bandwidth, plus a fixed overhead
   per layer (the runtime's per-layer work: Python, planning, small kernels);
4. token latency = flash + DRAM time (the runtime does not overlap them).

Machines (`MACHINES`): `this` takes its flash curve from the bench run's own disk measurements (the
disk GB/s measured at each configuration's request size) and its DRAM bandwidth from the bench's
mlx-lm run (model bytes / ms per token: an effective figure that includes the CPU compute); its
per-layer overhead is a constant measured on this machine. `m1-max` (flash ~6 GB/s sequential,
the paper's Figure 2 shape for random reads) and `phone` (~1 GB/s) are assumptions, stated below.
The estimate for `this` is compared with the measured ms/token (ratio estimate / measured).
"""

import argparse
import json
from pathlib import Path

import numpy as np

from ..calib.trace import Trace, as_mapped, default_trace

MIB = 1 << 20

# flash GB/s vs request bytes (random reads at the thread count the runtime uses), DRAM GB/s,
# per-layer overhead ms, memory GiB
MACHINES = {
    "m1-max": {
        "flash": {4096: 1.0, 16384: 2.5, 32768: 3.5, 65536: 4.5, 262144: 5.5, MIB: 6.0},
        "dram_gbps": 200.0,
        "layer_ms": 0.05,
        "memory_gib": 64,
        "note": "assumed: ~6 GB/s sequential flash, random-read curve shaped as the paper's Fig. 2; "
        "DRAM 200 GB/s effective (of 400)",
    },
    "phone": {
        "flash": {4096: 0.12, 16384: 0.35, 32768: 0.5, 65536: 0.7, 262144: 0.9, MIB: 1.0},
        "dram_gbps": 30.0,
        "layer_ms": 0.2,
        "memory_gib": 8,
        "note": "assumed: UFS-class flash ~1 GB/s sequential, DRAM 30 GB/s effective",
    },
}
THIS_LAYER_MS = 0.6  # per-layer runtime overhead on the project machine (CPU MLX, Python), see BENCHMARKS.md


def bandwidth(curve: dict, size: float) -> float:
    """GB/s at `size` bytes: log-linear interpolation of the curve, clamped at its ends."""
    xs = np.array(sorted(curve), dtype=np.float64)
    ys = np.array([curve[k] for k in sorted(curve)], dtype=np.float64)
    return float(np.interp(np.log(max(size, 1.0)), np.log(xs), ys))


def this_machine(bench: dict) -> dict:
    pts = {}
    for r in bench["configs"].values():
        if r.get("disk_gbps") and r.get("mean_request_bytes"):
            pts[int(r["mean_request_bytes"])] = r["disk_gbps"]
    dense = bench["configs"].get("mlx-lm", {})
    dram = bench["model_bytes"] / (dense["total_ms"] / 1e3) / 1e9 if dense.get("total_ms") else 10.0
    return {
        "flash": pts or {4096: 0.1, MIB: 1.0},
        "dram_gbps": dram,
        "layer_ms": THIS_LAYER_MS,
        "note": "measured in the bench run: disk GB/s at the configurations' request sizes; DRAM from mlx-lm",
    }


def coalesce(ids: np.ndarray, stride: int, max_gap: int) -> tuple:
    """(requests, bytes read) for sorted unit ids when the reader merges neighbours whose gap is at
    most `max_gap` bytes (it reads the gap and discards it, as the pread pool does)."""
    if len(ids) == 0:
        return 0, 0
    gaps = (np.diff(ids.astype(np.int64)) - 1) * stride
    merged = gaps <= max_gap
    return int(1 + np.count_nonzero(~merged)), int(len(ids) * stride + gaps[merged].sum())


class WindowCache:
    """Set-level model of UnitCache's window policy (no buffers): returns the units read per step."""

    def __init__(self, n: int, capacity: int, window: int):
        self.capacity, self.window = capacity, window
        self.last = np.full(n, -(1 << 40), dtype=np.int64)
        self.cached = np.zeros(n, dtype=bool)
        self.t = 0

    def step(self, active: np.ndarray) -> np.ndarray:
        t, self.t = self.t, self.t + 1
        mask = np.zeros_like(self.cached)
        mask[active] = True
        old = self.cached & ~mask & (self.last <= t - self.window)
        self.cached[old] = False
        miss = active[~self.cached[active]]
        self.last[active] = t
        if self.capacity <= 0:
            return miss
        room = self.capacity - int(self.cached.sum())
        if len(miss) > room:  # evict least recently active non-active units
            cand = np.flatnonzero(self.cached & ~mask)
            need = min(len(miss) - room, len(cand))
            if need > 0:
                self.cached[cand[np.argsort(self.last[cand], kind="stable")[:need]]] = False
            room = self.capacity - int(self.cached.sum())
        admit = miss[: max(0, room)]
        self.cached[admit] = True
        return miss


def simulate_config(name: str, r: dict, bench: dict, trace, machine: dict, tokens: int) -> dict:
    """Estimated ms/token (and its parts) of configuration `name` of a bench run on `machine`."""
    n, layers, stride = bench["units_per_layer"], bench["layers"], bench["stride"]
    cap = r.get("cache_units_per_layer", 0)
    dense = name in ("naive", "hybrid")
    pieces = 3
    window = bench.get("window", 5)
    max_gap = bench.get("max_gap_bytes") or 12 << 10
    caches = [WindowCache(n, cap, window) for _ in range(layers)]
    total_bytes = total_req = used_units = useful = 0
    io_s = 0.0
    all_ids = np.arange(n, dtype=np.int32)
    warm = window  # the prefill seeds the caches with the last `window` prompt tokens
    for t in range(warm + tokens):
        for layer in range(layers):
            active = all_ids if dense else trace.ids(t, layer)
            if dense and cap == 0:
                read = active
            elif dense:
                read = all_ids[cap:]  # the cached part stays, the rest is streamed
            else:
                read = caches[layer].step(active) if cap else active
            if t < warm:
                continue
            used_units += len(active)
            nbytes = len(read) * stride
            if len(read) == 0:
                continue
            if dense:  # streamed through the scratch buffer in order: big sequential reads
                req = max(1, -(-nbytes // MIB))
            elif name == "window-unbundled":  # one request per matrix per run of neighbours, no gaps read
                req = coalesce(read, stride, 0)[0] * pieces
            else:
                req, nbytes = coalesce(read, stride, max_gap)
            size = nbytes / req
            io_s += nbytes / (bandwidth(machine["flash"], min(size, MIB)) * 1e9)
            useful += len(read) * stride
            total_bytes += nbytes
            total_req += req
    per_unit = bench.get("row_stride", stride)  # bytes of one unit in DRAM (row incl. padding; dense if encoded)
    dram_bytes = bench["resident_bytes_loaded"] + used_units / tokens * per_unit
    dram_s = dram_bytes / (machine["dram_gbps"] * 1e9) + layers * machine["layer_ms"] / 1e3
    io_ms = io_s / tokens * 1e3
    ms = io_ms + dram_s * 1e3
    return {
        "io_ms": io_ms,
        "dram_ms": dram_s * 1e3,
        "total_ms": ms,
        "tokens_per_s": 1e3 / ms,
        "bytes_per_token": useful / tokens,
        "bytes_read_per_token": total_bytes / tokens,
        "mean_request_bytes": total_bytes / max(1, total_req),
    }


def simulate(bench: dict, trace, machines=("this", "m1-max", "phone"), tokens: int = None) -> dict:

    tokens = tokens or bench["tokens"]
    mapped = as_mapped(trace, bench["layers"], bench["units_per_layer"])
    out = {"machines": {}, "model": bench["model"], "budget": bench["memory_budget"], "tokens": tokens}
    for m in machines:
        hw = this_machine(bench) if m == "this" else MACHINES[m]
        res = {}
        for name, r in bench["configs"].items():
            if name == "mlx-lm" or "skipped" in r:
                continue
            est = simulate_config(name, r, bench, mapped, hw, tokens)
            if m == "this":
                est["measured_ms"] = r["total_ms"]  # the median: robust to stalls of a shared machine
                est["ratio"] = est["total_ms"] / r["total_ms"]
                est["measured_bytes_per_token"] = r["bytes_per_token"]
            res[name] = est
        out["machines"][m] = {
            "hardware": {k: v for k, v in hw.items() if k != "flash"},
            "flash_curve_gbps": {str(k): v for k, v in sorted(hw["flash"].items())},
            "configs": res,
        }
    return out


def table(sim: dict) -> str:
    lines = []
    for m, d in sim["machines"].items():
        hw = d["hardware"]
        lines.append(f"\n{m}: DRAM {hw['dram_gbps']:.1f} GB/s, {hw['layer_ms']} ms/layer overhead; {hw['note']}")
        lines.append(
            "| config | flash->DRAM / token | mean request | est. I/O ms | est. DRAM ms | est. ms/token | tokens/s |"
            + (" measured ms/token | est./measured |" if m == "this" else "")
        )
        lines.append("|---|---|---|---|---|---|---|" + ("---|---|" if m == "this" else ""))
        for name, e in d["configs"].items():
            row = (
                f"| {name} | {e['bytes_per_token'] / MIB:.2f} MiB | {e['mean_request_bytes'] / 1024:.1f} KiB | "
                f"{e['io_ms']:.1f} | {e['dram_ms']:.1f} | {e['total_ms']:.1f} | {e['tokens_per_s']:.2f} |"
            )
            if m == "this":
                row += f" {e['measured_ms']:.1f} | {e['ratio']:.2f} |"
            lines.append(row)
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description="Estimate flash-runtime tokens/s on other machines from a trace.")
    p.add_argument("--bench", required=True, help="JSON written by python -m mlx_flash.bench --json.")
    p.add_argument("--trace", default=None, help="Trace .npz (default: the bench's default SmolLM2 trace).")
    p.add_argument("--machines", default="this,m1-max,phone")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)

    bench = json.loads(Path(a.bench).read_text())
    if a.trace:
        trace = Trace.load(a.trace)
    else:
        trace = default_trace()[0]
    sim = simulate(bench, trace, [m for m in a.machines.split(",") if m])
    print(
        f"simulated {sim['model']} at budget {sim['budget']}, {sim['tokens']} tokens (trace-driven; "
        f"for a real model run with an oracle, the trace stands in for its active sets)"
    )
    print(table(sim))
    if a.json:
        Path(a.json).write_text(json.dumps(sim, indent=1))
    return sim


if __name__ == "__main__":
    main()
