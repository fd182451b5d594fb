"""Before the first token: what this machine can give, what the model needs, the plan, the bytes a token reads and
the disk's rate, so a user knows whether a run is worth it (no weight is loaded).

    python -m mlx_flash.doctor [--model DIR] [--memory-budget auto] [--max-context 2048] [--kv-bits 8] [--seconds 2]

Bytes a token reads: a dense model reads every unit its caches do not hold (and what the plan streams); an MoE model
its router's experts that miss its caches, here under uniform routing (each of a layer's experts equally likely, the
worst case for a cache: a model's own routing repeats more). Tokens/s from reads alone is the disk's rate over those
bytes: compute and what is not overlapped come on top.
"""

import argparse
import sys

import numpy as np

from .budget import fmt_bytes
from .default_model import model_dir
from .errors import FlashError
from .format.directory import FlashDir
from .io.available import available
from .io.reader import open_reader
from .loader import load
from .tools.bench_io import run_native

READ_BLOCK = 1 << 20  # the disk is measured at random reads of this size (an expert's or a run of neurons' scale)


def reads_per_token(fd: FlashDir, plan) -> float:
    """Bytes a decode token reads from flash under `plan` (module doc)."""
    total = 0.0
    for regions, caps in zip(fd.layers, plan.capacity):
        for name, r in regions.items():
            used = min(r.n_units, fd.experts_per_token) if name == "experts" else r.n_units
            total += used * (r.n_units - caps[name]) / r.n_units * r.stride  # (each used unit misses as often)
    return total + sum(g.nbytes for g in plan.streamed if g.kind != "rows")


def disk_rate(path, seconds: float, threads: int = 16) -> float:
    """Bytes/s of random READ_BLOCK reads of `path` (uncached: O_DIRECT / F_NOCACHE) for about `seconds`."""
    size = path.stat().st_size
    reader = open_reader(path, threads=threads)
    try:
        block = min(READ_BLOCK, size)
        block -= block % reader.alignment
        gib_s, _ = run_native(reader, size, block, seconds, np.random.default_rng(0))
        return gib_s * 2**30
    finally:
        reader.close()


def report(path, memory_budget="auto", context: int = 2048, kv_bits: int = None, seconds: float = 2.0, out=sys.stdout):
    fd = FlashDir(path)
    machine = available()
    plan, notes = load(path, memory_budget=memory_budget, context=context, kv_bits=kv_bits, plan_only=True)
    strides = fd.strides
    units = {k: r.n_units for k, r in fd.layers[-1].items()}
    kind = f"{fd.experts_per_token} of {units.get('experts')} experts a token" if fd.experts_per_token else "dense"
    print(f"machine: can give {fmt_bytes(machine.bytes or 0)} now ({machine.describe()})", file=out)
    print(
        f"model: {fd.path}: {fmt_bytes(fd.model_bytes)} ({kind}), of which resident weights "
        f"{fmt_bytes(fd.resident_bytes)} and FFN units {fmt_bytes(fd.ffn_bytes)} in {len(fd.layers)} layers"
        + ("" if fd.sources is None else f", read in place from {fd.units_where}"),
        file=out,
    )
    for note in notes:
        if note:
            print(note, file=out)
    print(f"plan ({context} tokens of context): {plan.describe(strides, units)}", file=out)
    read = reads_per_token(fd, plan)
    path = fd.largest_unit_path
    rate = disk_rate(path, seconds)
    print(f"disk: {fmt_bytes(rate)}/s at random {fmt_bytes(READ_BLOCK)} reads of {path}", file=out)
    if read == 0:
        print("reads: none a token (every unit cached): the speed is the compute's", file=out)
        return plan, read, rate
    routing = ", uniform routing" if fd.experts_per_token else ""
    print(
        f"reads: {fmt_bytes(read)} a token{routing}: at most {rate / read:.2f} tokens/s from reads alone "
        "(compute, and reads it does not overlap, come on top)",
        file=out,
    )
    return plan, read, rate


def setup_arg_parser():
    p = argparse.ArgumentParser(
        description="What this machine can give a model, its plan and the speed its reads allow."
    )
    p.add_argument("--model", default=None, help="Flash directory (default: SmolLM2-135M-Instruct, converted once).")
    p.add_argument("--memory-budget", default="auto", help="Bytes, 2GB, 512MiB, 50%% of the model, or auto.")
    p.add_argument("--max-context", type=int, default=2048, help="Prompt + generated tokens the KV cache holds.")
    p.add_argument("--kv-bits", type=int, default=None, help="A quantised KV cache (4 or 8).")
    p.add_argument("--seconds", type=float, default=2.0, help="How long to measure the disk.")
    return p


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    try:
        report(model_dir(args.model), args.memory_budget, args.max_context, args.kv_bits, args.seconds)
    except (FlashError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
