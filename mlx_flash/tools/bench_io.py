"""Benchmark the I/O engine against fio on the same file, block size and thread count.

    python -m mlx_flash.tools.bench_io [--dir DIR] [--size-gib 4] [--json out.json]

1. Random aligned uncached (O_DIRECT / F_NOCACHE) reads of each block size with each
   thread count: the native pool (batches of `threads * 64` reads, no coalescing) and,
   interleaved in the same run, fio (ioengine=psync, direct=1, numjobs=threads). Every point
   is repeated and the medians are reported, with native/fio (median of per-repeat ratios).
2. The best thread count per size and the recommended default.
3. The gap policy: `max_gap_bytes` derived from the measured cost-per-request curve
   (mlx_flash.io.reader.max_gap_from_measurements).
4. The coalescing gain: groups of N adjacent bundles read as separate requests vs
   coalesced, and groups with one-bundle holes read separately vs gap-filled.
"""

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from .. import blas
from ..compute import cpu_gemv
from ..io.reader import DEFAULT_THREADS, aligned_buffer, have_native, max_gap_from_measurements, open_reader

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover
    tqdm = None

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}


def parse_size(s: str) -> int:
    s = s.strip().lower()
    num = s.rstrip("kmgib")
    return int(float(num) * _UNITS[s[len(num) :]])


def fmt_size(n: int) -> str:
    for unit, k in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k}{unit}"
    return str(n)


def setup_arg_parser():
    """Set up and return the argument parser."""
    parser = argparse.ArgumentParser(description="Benchmark the mlx_flash I/O engine against fio")
    parser.add_argument(
        "--dir",
        type=str,
        default=None,
        help="Directory for the test file (default: a temporary directory under the cwd; "
        "must be on the disk to measure, not tmpfs)",
    )
    parser.add_argument("--size-gib", type=float, default=4.0, help="Test file size in GiB (default: 4)")
    parser.add_argument("--keep", action="store_true", help="Keep the test file (and reuse it next time)")
    parser.add_argument(
        "--block-sizes",
        type=str,
        default="4k,16k,32k,64k,128k,1m",
        help="Comma-separated read sizes (default: 4k,16k,32k,64k,128k,1m)",
    )
    parser.add_argument(
        "--threads", type=str, default="1,2,4,8,16,32", help="Comma-separated thread counts (default: 1,2,4,8,16,32)"
    )
    parser.add_argument("--seconds", type=float, default=1.5, help="Run time of each point (default: 1.5)")
    parser.add_argument("--repeats", "-n", type=int, default=5, help="Repeats of each point (default: 5)")
    parser.add_argument(
        "--inflight",
        type=int,
        default=2,
        help="Batches queued at once by the native pool (default: 2; 1 = synchronous read())",
    )
    parser.add_argument("--no-fio", action="store_true", help="Skip fio (native pool only)")
    parser.add_argument("--python-fallback", action="store_true", help="Also measure the pure-Python fallback reader")
    parser.add_argument(
        "--bundle-sizes",
        type=str,
        default="4k,16k,32k",
        help="Bundle sizes for the coalescing test (default: 4k,16k,32k)",
    )
    parser.add_argument(
        "--adjacent", type=int, default=16, help="Adjacent bundles per group in the coalescing test (default: 16)"
    )
    parser.add_argument(
        "--coalesce-threads",
        type=int,
        default=None,
        help="Threads for the coalescing test (default: the recommended count)",
    )
    parser.add_argument("--json", type=str, default=None, help="Write all results to this JSON file")
    parser.add_argument("--seed", type=int, default=0, help="Random seed")
    return parser


# --------------------------------------------------------------------------------------
# Machine description


def _run(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_info(path: str) -> dict:
    import mlx.core as mx

    info = {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "mlx": mx.__version__,
        "kernel": platform.release(),
        "platform": platform.platform(),
        "cores": os.cpu_count(),
        "blas": blas.status,
        "cpu_matvecs": dict(cpu_gemv.info(), on=cpu_gemv.available()),
    }
    for line in _run(["lscpu"]).splitlines():
        if line.startswith("Model name:"):
            info["cpu"] = line.split(":", 1)[1].strip()
    try:
        with open("/proc/meminfo") as f:
            info["ram_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    fio = shutil.which("fio")
    info["fio"] = _run([fio, "--version"]) if fio else None
    df = _run(["df", "-T", path]).splitlines()
    if len(df) > 1:
        dev, fstype = df[1].split()[:2]
        info["filesystem"] = f"{fstype} on {dev}"
        name = os.path.basename(dev)
        q = f"/sys/block/{name}/queue"
        if os.path.isdir(q):

            def rd(k):
                try:
                    with open(os.path.join(q, k)) as f:
                        return f.read().strip()
                except OSError:
                    return "?"

            info["disk"] = (
                f"{name}: rotational={rd('rotational')} logical_block={rd('logical_block_size')} "
                f"scheduler={rd('scheduler')} max_sectors_kb={rd('max_sectors_kb')}"
            )
    return info


# --------------------------------------------------------------------------------------
# Test file


def make_test_file(path: str, nbytes: int, progress: bool = True) -> None:
    if os.path.exists(path) and os.path.getsize(path) == nbytes:
        return
    chunk = 16 << 20
    rng = np.random.default_rng(1234)
    block = rng.integers(0, 256, size=chunk, dtype=np.uint8)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    bar = (
        tqdm(total=nbytes, unit="B", unit_scale=True, desc="writing test file", disable=not progress) if tqdm else None
    )
    try:
        done = 0
        while done < nbytes:
            n = min(chunk, nbytes - done)
            block[:8] = np.frombuffer(np.int64(done).tobytes(), np.uint8)  # every chunk distinct
            os.write(fd, memoryview(block)[:n])
            done += n
            if bar:
                bar.update(n)
        os.fsync(fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
        if bar:
            bar.close()


# --------------------------------------------------------------------------------------
# Measurements


def run_native(
    reader, file_size: int, bs: int, seconds: float, rng, per_thread: int = 64, inflight: int = 2, dest_bytes: int = 0
):
    """Random aligned reads of `bs` bytes for `seconds`: (GiB/s, IOPS). Batches of
    threads * per_thread reads, `inflight` batches queued at once (submit/wait), so the
    workers never wait for the Python thread between batches, as fio's jobs never do.
    dest_bytes=0: the reads cycle through 2 * threads block-sized slots per batch (like fio's
    one buffer per job); else they are spread over dest_bytes (like a large neuron cache)."""
    batch = reader.threads * per_thread
    slots = max(1, min(batch, dest_bytes // bs if dest_bytes else 2 * reader.threads))
    bufs = [aligned_buffer(slots * bs) for _ in range(inflight)]
    lengths = np.full(batch, bs, np.int64)
    dest = (np.arange(batch, dtype=np.int64) % slots) * bs
    nblocks = file_size // bs
    n, k, pending = 0, 0, []
    t0 = time.perf_counter()
    while True:
        offsets = rng.integers(0, nblocks, batch, dtype=np.int64) * bs
        base, off = bufs[k % inflight]
        k += 1
        if inflight <= 1:
            reader.read(base, offsets, lengths, dest + off, coalesce=False)
            n += batch
        else:
            pending.append(reader.submit(base, offsets, lengths, dest + off, coalesce=False))
            if len(pending) >= inflight:
                reader.wait(pending.pop(0))
                n += batch
        dt = time.perf_counter() - t0
        if dt >= seconds:
            break
    for h in pending:  # count what finishes, and the time it takes
        reader.wait(h)
        n += batch
    dt = time.perf_counter() - t0
    return n * bs / dt / 2**30, n / dt


def run_fio(path: str, file_size: int, bs: int, threads: int, seconds: float):
    """fio, invoked as in shared/tools/disk-limit: (GiB/s, IOPS)."""
    cmd = [
        "fio",
        "--name=r",
        f"--filename={path}",
        f"--size={file_size}",
        "--rw=randread",
        f"--bs={bs}",
        "--direct=1",
        "--ioengine=psync",
        f"--numjobs={threads}",
        "--time_based",
        f"--runtime={seconds}s",
        "--group_reporting",
        "--output-format=json",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"fio failed: {out.stderr.strip()}")
    r = json.loads(out.stdout)["jobs"][0]["read"]
    return r["bw_bytes"] / 2**30, r["iops"]


def coalescing_test(path, file_size, bundle, adjacent, threads, seconds, repeats, rng):
    """Groups of `adjacent` bundles at random aligned places, 64 groups per batch.
    Returns a dict of median useful GiB/s for each way of reading them."""
    groups = 64
    results = {}
    span = adjacent * bundle * 2  # room for the holed layout
    nplaces = file_size // span
    with open_reader(path, threads=threads, direct=True) as r:
        base, off = aligned_buffer(groups * adjacent * bundle)
        k = np.arange(adjacent, dtype=np.int64)
        cases = {
            # adjacent bundles: separate requests vs one coalesced request per group
            "adjacent separate": (1, False, 0),
            "adjacent coalesced": (1, True, 0),
            # every other bundle (holes of one bundle): separate vs gap-filled
            "holes separate": (2, False, 0),
            "holes gap-filled": (2, True, bundle),
        }
        runs = {name: [] for name in cases}
        for _ in range(repeats):
            for name, (step, coalesce, gap) in cases.items():
                r.max_gap_bytes = gap
                r.max_request_bytes = max(1 << 20, span)
                n, t0 = 0, time.perf_counter()
                r.reset_stats()
                while True:
                    starts = rng.choice(nplaces, groups, replace=False).astype(np.int64) * span
                    fo = (starts[:, None] + k[None, :] * step * bundle).reshape(-1)
                    lengths = np.full(fo.size, bundle, np.int64)
                    dest = off + np.arange(fo.size, dtype=np.int64) * bundle
                    r.read(base, fo, lengths, dest, coalesce=coalesce)
                    n += fo.size
                    dt = time.perf_counter() - t0
                    if dt >= seconds:
                        break
                st = r.stats()
                runs[name].append((n * bundle / dt / 2**30, st["requests"] / max(1, st["reads"])))
        for name, v in runs.items():
            results[name] = {
                "gib_s": statistics.median(x[0] for x in v),
                "requests_per_read": statistics.median(x[1] for x in v),
            }
    return results


def main():
    parser = setup_arg_parser()
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.block_sizes.split(",")]
    thread_counts = [int(t) for t in args.threads.split(",")]
    bundles = [parse_size(s) for s in args.bundle_sizes.split(",")]
    use_fio = not args.no_fio and shutil.which("fio") is not None
    if not args.no_fio and not use_fio:
        print("fio is not installed (apt-get install -y fio): native pool only", file=sys.stderr)
    if not have_native():
        print("warning: the native extension is not built; measuring the Python fallback", file=sys.stderr)
    rng = np.random.default_rng(args.seed)

    made_dir = args.dir is None
    d = tempfile.mkdtemp(prefix=".bench_io.", dir=os.getcwd()) if made_dir else args.dir
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, "bench_io.bin")
    file_size = int(args.size_gib * 2**30) // (1 << 20) * (1 << 20)
    results = {
        "command": " ".join(["python -m mlx_flash.tools.bench_io"] + sys.argv[1:]),
        "machine": machine_info(d),
        "file_size": file_size,
        "points": [],
        "seconds": args.seconds,
        "repeats": args.repeats,
        "inflight": args.inflight,
    }
    try:
        make_test_file(path, file_size)
        engines = ["native", "spread"] + (["python"] if args.python_fallback else []) + (["fio"] if use_fio else [])
        total = len(sizes) * len(thread_counts) * args.repeats * len(engines)
        bar = tqdm(total=total, desc="random reads") if tqdm else None
        for bs in sizes:
            for t in thread_counts:
                samples = {e: [] for e in engines}
                readers = {"native": open_reader(path, threads=t, direct=True)}
                readers["spread"] = readers["native"]
                if args.python_fallback:
                    readers["python"] = open_reader(path, threads=t, direct=True, native=False)
                for rep in range(args.repeats):
                    # rotate the order so that drifting load hits every engine alike
                    k = rep % len(engines)
                    order = engines[k:] + engines[:k]
                    for e in order:
                        if e == "fio":
                            samples[e].append(run_fio(path, file_size, bs, t, args.seconds))
                        else:
                            samples[e].append(
                                run_native(
                                    readers[e],
                                    file_size,
                                    bs,
                                    args.seconds,
                                    rng,
                                    inflight=args.inflight,
                                    dest_bytes=(64 << 20) if e == "spread" else 0,
                                )
                            )
                        if bar:
                            bar.update(1)
                for r in set(readers.values()):
                    r.close()
                point = {"block": bs, "threads": t}
                for e, v in samples.items():
                    point[e] = {
                        "gib_s": statistics.median(x[0] for x in v),
                        "iops": statistics.median(x[1] for x in v),
                        "samples_gib_s": [round(x[0], 4) for x in v],
                    }
                if use_fio:
                    for e in engines[:-1]:
                        point[f"{e}_vs_fio"] = statistics.median(
                            a[0] / b[0] for a, b in zip(samples[e], samples["fio"])
                        )
                    point["ratio"] = point["native_vs_fio"]
                    # the median of per-repeat ratios and the ratio of medians both, honestly
                    point["ratio_of_medians"] = point["native"]["gib_s"] / point["fio"]["gib_s"]
                results["points"].append(point)
        if bar:
            bar.close()

        # best thread count per size; recommended = best geometric mean of (GiB/s / best at that size)
        best = {}
        for bs in sizes:
            pts = [p for p in results["points"] if p["block"] == bs]
            best[bs] = max(pts, key=lambda p: p["native"]["gib_s"])["threads"]
        score = {}
        for t in thread_counts:
            rel = []
            for bs in sizes:
                pts = {p["threads"]: p["native"]["gib_s"] for p in results["points"] if p["block"] == bs}
                rel.append(pts[t] / max(pts.values()))
            score[t] = float(np.exp(np.mean(np.log(rel))))
        recommended = max(score, key=lambda t: (round(score[t], 2), -t))
        results["best_threads"] = {fmt_size(k): v for k, v in best.items()}
        results["thread_score"] = score
        results["recommended_threads"] = recommended

        # gap policy from the cost-per-request curve at the recommended thread count
        pts = sorted((p for p in results["points"] if p["threads"] == recommended), key=lambda p: p["block"])
        s = [p["block"] for p in pts]
        cost = [1.0 / p["native"]["iops"] for p in pts]
        gaps = {"linear_fit": max_gap_from_measurements(s, cost)}
        for b in bundles:
            gaps[fmt_size(b)] = max_gap_from_measurements(s, cost, request_bytes=b)
        results["max_gap_bytes"] = gaps

        ct = args.coalesce_threads or recommended
        co = {}
        for b in tqdm(bundles, desc="coalescing") if tqdm else bundles:
            co[fmt_size(b)] = coalescing_test(path, file_size, b, args.adjacent, ct, args.seconds, args.repeats, rng)
        results["coalescing"] = {"threads": ct, "adjacent": args.adjacent, "groups_per_batch": 64, "results": co}
    finally:
        if not args.keep:
            try:
                os.remove(path)
            except OSError:
                pass
            if made_dir:
                shutil.rmtree(d, ignore_errors=True)

    print_report(results, use_fio, args.python_fallback)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def print_report(res, use_fio, with_python):
    m = res["machine"]
    print(f"\n{res['command']}")
    print(
        f"machine: {m.get('cpu')}, {m.get('cores')} cores, {m.get('ram_gib')} GiB RAM; {m.get('filesystem')}; "
        f"{m.get('disk', '')}"
    )
    print(
        f"versions: python {m['python']}, mlx {m['mlx']}, numpy {m['numpy']}, {m.get('fio') or 'no fio'}, "
        f"kernel {m['kernel']}"
    )
    print(
        f"file {res['file_size'] / 2**30:.1f} GiB, random aligned O_DIRECT reads, {res['seconds']} s x "
        f"{res['repeats']} repeats per point, medians; native: batches of threads x 64 reads, "
        f"{res['inflight']} in flight\n"
    )
    hdr = f"| {'block':>5} | {'threads':>7} | {'native GiB/s':>12} | {'native IOPS':>11} | {'spread GiB/s':>12} |"
    if with_python:
        hdr += f" {'python GiB/s':>12} |"
    if use_fio:
        hdr += f" {'fio GiB/s':>9} | {'fio IOPS':>8} | {'native/fio':>10} | {'spread/fio':>10} |"
    print(hdr)
    print("|" + "|".join("-" * (len(c)) for c in hdr.split("|")[1:-1]) + "|")
    for p in res["points"]:
        row = (
            f"| {fmt_size(p['block']):>5} | {p['threads']:>7} | {p['native']['gib_s']:>12.3f} | "
            f"{p['native']['iops']:>11.0f} | {p['spread']['gib_s']:>12.3f} |"
        )
        if with_python:
            row += f" {p['python']['gib_s']:>12.3f} |"
        if use_fio:
            row += (
                f" {p['fio']['gib_s']:>9.3f} | {p['fio']['iops']:>8.0f} | {p['native_vs_fio'] * 100:>9.0f}% |"
                f" {p['spread_vs_fio'] * 100:>9.0f}% |"
            )
        print(row)
    print(
        "native: reads cycle through 2 x threads block-sized buffers (as fio's jobs reuse one buffer); "
        "spread: through a 64 MiB buffer (as a neuron cache); x/fio: median of per-repeat ratios"
    )
    print(f"\nbest threads per size: {res['best_threads']}")
    print(
        "thread score (geo-mean of GiB/s relative to the best at each size): "
        + ", ".join(f"{t}: {s:.2f}" for t, s in res["thread_score"].items())
    )
    print(f"recommended threads: {res['recommended_threads']} (current default {DEFAULT_THREADS})")
    print(f"max_gap_bytes from the cost curve at {res['recommended_threads']} threads: {res['max_gap_bytes']}")
    co = res["coalescing"]
    print(f"\ncoalescing: 64 groups of {co['adjacent']} bundles per batch, {co['threads']} threads, useful GiB/s")
    print(
        f"| {'bundle':>6} | {'adjacent separate':>17} | {'adjacent coalesced':>18} | {'gain':>5} | "
        f"{'holes separate':>14} | {'holes gap-filled':>16} | {'gain':>5} |"
    )
    print("|--------|-------------------|--------------------|-------|----------------|------------------|-------|")
    for b, r in co["results"].items():
        a, c = r["adjacent separate"]["gib_s"], r["adjacent coalesced"]["gib_s"]
        h, g = r["holes separate"]["gib_s"], r["holes gap-filled"]["gib_s"]
        print(f"| {b:>6} | {a:>17.3f} | {c:>18.3f} | {c / a:>4.2f}x | {h:>14.3f} | {g:>16.3f} | {g / h:>4.2f}x |")


if __name__ == "__main__":
    main()
