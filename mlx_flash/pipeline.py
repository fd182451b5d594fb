"""Pipeline stages over mx.distributed: a model split over machines, each streaming its own layers from its own SSD.

    mlx.launch --backend ring -n 2 -- python -m mlx_flash.generate --prompt "..." --memory-budget 1GiB --stats

Under mlx.launch (ring over TCP, JACCL over Thunderbolt 5) every rank runs the same command. Each loads a contiguous
share of the layers (`split_layers`: balanced by bytes, or --pipeline-split, as mlx-lm's `pipeline(group, split)`:
layers per rank, rank 0 the last ones) with `load(layers=...)` (models/stage.py), so it plans, reads and holds only
its share under its own --memory-budget. As in mlx-lm's PipelineMixin the last rank holds the embedding and rank 0
the final norm and LM head: rank 0 tokenises, samples, prints, and drives every forward pass:

    rank 0      broadcasts the pass (an all_sum): its tokens, the KV offset it starts at, prompt or not; or stop;
                or, a server between requests, a ping
    rank n-1    embeds the tokens, runs its layers, sends the float32 rows [m, hidden] to rank n-2
    rank r      receives the rows from rank r+1, runs its layers, sends them on to rank r-1
    rank 0      receives them, runs its layers and the head: the logits, sampled as in one process

Every rank so sees the same tokens (prompt chunks of any length, prompt-lookup drafts, verification passes); a
rejected draft is trimmed by the next pass's offset, and the stop is rank 0's. Each rank's share is its model's
`forward.stage` (engine/forward.py): MLX's forward, or the native CPU step beneath it where that applies, with any KV
cache kind. The rows cross as float32 (lossless from float16 or bfloat16 activations) and each layer runs what it
runs in one process: greedy tokens are the single process's, bit for bit, where every rank runs the implementation
the single process would (ranks of different implementations each compute their own arithmetic: the native step's
int8 activations, say, against MLX's float ones).

The server (mlx_flash.server) runs the same way: rank 0 serves HTTP, one request at a time through these passes.

Failure: a rank that ends makes the others' next exchange fail (the ring backend: "connection to a peer was lost");
one that stops answering is caught by a watchdog thread: no exchange waits longer than MLX_FLASH_PIPELINE_TIMEOUT
seconds (default 30; a prompt chunk of m positions 1 + m/32 times that; connecting, loading and the first pass
LOAD_WAITS times). Each rank prints
one line and exits with status 1.
"""

import json
import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from .budget import fmt_bytes
from .errors import FlashError
from .format.directory import FlashDir
from .io.memory import give_back
from .models.inspect import instantiate
from .models.stage import StageDir, layer_paths

TIMEOUT = float(os.environ.get("MLX_FLASH_PIPELINE_TIMEOUT", "30"))
LOAD_WAITS = 20  # loading (hashing, reading the resident weights) may differ between ranks by far more than a pass
HEADER = 6  # a pass's command: op, positions, KV offset, prompt, status, its number; then the tokens
INLINE = 256  # tokens sent with the header (a longer pass sends the rest in a second exchange)
MAX_PASS = 1 << 20  # positions a pass may hold (a command claiming more is a broken exchange)
PASS, STOP, PING = 1, 2, 3
KEPT = 1024  # per-pass stats a follower keeps past a ping (a server runs for long)


class PipelineError(FlashError):
    """A pipeline stage cannot go on: another rank failed, ended or stopped answering, or the split is wrong."""


def launched() -> bool:
    """Whether this process is one rank of an mlx.launch (or a launch with the same environment)."""
    return any(k in os.environ for k in ("MLX_RANK", "OMPI_COMM_WORLD_RANK"))


class _Watchdog:
    """Ends the process with one line when an exchange with the other ranks waits longer than its timeout (MLX's
    ring backend waits forever on a peer that stopped without closing its sockets)."""

    def __init__(self, rank: int):
        self.rank, self.deadline, self.what = rank, None, ""
        threading.Thread(target=self._run, daemon=True, name="mlx_flash-pipeline-watchdog").start()

    @contextmanager
    def __call__(self, what: str, timeout: float = None):
        self.what, self.limit = what, timeout or TIMEOUT
        self.deadline = time.monotonic() + self.limit
        try:
            yield
        except RuntimeError as e:  # the ring backend's "connection to a peer was lost"
            raise PipelineError(
                f"pipeline rank {self.rank}: {what}: another rank ended or cannot be reached ({e})"
            ) from None
        finally:
            self.deadline = None

    def _run(self):
        while True:
            time.sleep(0.2)
            deadline = self.deadline
            if deadline is not None and time.monotonic() > deadline:
                print(
                    f"error: pipeline rank {self.rank}: {self.what}: no answer within {self.limit:.0f} s "
                    "(MLX_FLASH_PIPELINE_TIMEOUT): another rank died or cannot be reached",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(1)


class Ranks:
    """The ranks of a launch, as this one sees them: mx.distributed's group, this rank, their number, the watchdog."""

    def __init__(self, group, watch: _Watchdog):
        self.mx, self.rank, self.size, self.watch = group, group.rank(), group.size(), watch


def init() -> Optional[Ranks]:
    """The ranks (2 or more) this process is one of, under mlx.launch; None for a single process."""
    if not launched():
        return None
    rank = int(os.environ.get("MLX_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    watch = _Watchdog(rank)
    with watch("connecting to the other ranks", LOAD_WAITS * TIMEOUT):  # (the ranks' imports take their time)
        group = mx.distributed.init()
    return Ranks(group, watch) if group.size() > 1 else None


def parse_split(text: Optional[str], size: int, n_layers: int) -> Optional[List[int]]:
    """--pipeline-split "10,20": layers per rank (rank 0 the last ones, as mlx-lm's); PipelineError if it does not
    give each of `size` ranks at least one layer and all `n_layers` in total."""
    if text is None:
        return None
    try:
        split = [int(s) for s in text.split(",")]
    except ValueError:
        raise PipelineError(
            f"--pipeline-split {text!r}: give the layers of each rank as integers, e.g. 12,18"
        ) from None
    if len(split) != size or any(s < 1 for s in split) or sum(split) != n_layers:
        raise PipelineError(
            f"--pipeline-split {text}: needs {size} positive counts (one per rank) summing to the model's "
            f"{n_layers} layers"
        )
    return split


def split_layers(fd: FlashDir, size: int, split: Optional[Sequence[int]] = None) -> List[Tuple[int, int]]:
    """(start, stop) of each rank's layers: `split` (layers per rank, rank 0 the last ones) or contiguous shares as
    even in bytes as they can be (the embedding counted with the first stage, the head with the last)."""
    n = len(fd.layers)
    if size > n:
        raise PipelineError(f"{size} ranks for a model of {n} layers: each rank needs at least one layer")
    if split is None:
        weights = _weights(fd)
        split = list(reversed(_balanced(weights, size)))
    bounds, stop = [], n
    for count in split:  # rank 0 first: the last layers
        bounds.append((stop - count, stop))
        stop -= count
    return bounds


def _weights(fd: FlashDir) -> List[int]:
    """Per layer, its bytes; the first and last layers carry the embedding's and the head's."""
    index = fd.resident_index()
    prefix = layer_paths(instantiate(fd.config))[0].rsplit(".", 1)[0] + "."  # "model.layers."
    weights = [sum(r.nbytes for r in regions.values()) for regions in fd.layers]
    outside = 0
    for name, t in index.items():
        if name.startswith(prefix):
            weights[int(name[len(prefix) :].split(".", 1)[0])] += t.nbytes
        else:
            outside += t.nbytes
    weights[0] += outside // 2  # the embedding (first) and the norm and head (last), about half each
    weights[-1] += outside - outside // 2
    return weights


def _balanced(weights: Sequence[int], parts: int) -> List[int]:
    """Layer counts of `parts` contiguous runs of `weights` whose largest sum is the least (dynamic programming)."""
    n = len(weights)
    cum = np.concatenate([[0], np.cumsum(weights)])
    best = [[float("inf")] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for p in range(1, parts + 1):
        for j in range(p, n - parts + p + 1):
            for i in range(p - 1, j):
                cost = max(best[p - 1][i], cum[j] - cum[i])
                if cost < best[p][j]:
                    best[p][j], cut[p][j] = cost, i
    counts, j = [], n
    for p in range(parts, 0, -1):
        i = cut[p][j]
        counts.append(j - i)
        j = i
    return counts[::-1]


def stage_layers(path, group, args) -> Tuple[int, int]:
    """This rank's (start, stop) for a command's arguments (--pipeline-split, and the options stages support)."""
    fd = FlashDir(path)
    calibrated = ((fd.manifest.get("sparsity") or {}).get("selector") or {}).get("name")
    if args.sparsity not in ("auto", "dense") or (args.sparsity == "auto" and calibrated):
        raise PipelineError(
            "pipeline stages run dense FFNs and MoE experts: give --sparsity dense (a selector's arrays are per "
            "layer of the whole model)"
        )
    split = parse_split(args.pipeline_split, group.size, len(fd.layers))
    return split_layers(fd, group.size, split)[group.rank]


def run(stage, generate, stats: bool) -> None:
    """A command's run on this rank: rank 0 calls `generate` (its passes drive the others) and then stops the others,
    which follow; with `stats`, rank 0 prints every rank's figures. PipelineError on the others if rank 0 failed."""
    status = 1
    if stage.rank == 0:
        try:
            generate()
            status = 0
        finally:
            stage.stop(status)
    else:
        status = stage.follow()
    if status:
        raise PipelineError(f"pipeline rank {stage.rank}: rank 0 ended with an error (see the error it printed)")
    rows = stage.gather() if stats else None
    if rows:
        print_stages(rows)


def agree(group, error: Optional[BaseException], value: int = 0, timeout: float = None) -> int:
    """Every rank's outcome of a step (error None: it went well) and rank 0's `value`: raise this rank's error, or a
    PipelineError naming the ranks that failed, so that all ranks stop together; else return rank 0's value."""
    rank, size = group.rank, group.size
    mine = np.zeros(size + 1, np.int64)
    mine[rank] = error is not None
    mine[size] = value if rank == 0 else 0
    with group.watch("waiting for every rank to be ready", timeout):
        total = np.array(mx.distributed.all_sum(mx.array(mine), group=group.mx, stream=mx.cpu))
    if error is not None:
        raise error
    failed = [r for r in range(size) if total[r]]
    if failed:
        names = f"rank {failed[0]}" if len(failed) == 1 else f"ranks {', '.join(map(str, failed))}"
        raise PipelineError(f"pipeline rank {rank}: {names} failed (see the error it printed)")
    return int(total[size])


class PassClock:
    """A stage's tokens in its Stats: its own work, not the waits for the other ranks. A token still closes at the
    next one's start (as in one process: reads the read-ahead finishes in between count), less the time idle."""

    def __init__(self, stats):
        self.stats, self.idle_from = stats, None

    def begin(self, prompt: bool) -> None:
        closed = len(self.stats.tokens)
        idle = 0.0 if self.idle_from is None else time.perf_counter() - self.idle_from
        self.stats.touch(prefill=prompt)
        if len(self.stats.tokens) > closed:
            self.stats.tokens[-1].total_s -= idle

    def done(self) -> None:
        self.idle_from = time.perf_counter()


class Stage:
    """This rank's layers in the pipeline (module doc): on rank 0 the model's pass (`_Passes` calls it as it calls
    `model.forward`), on the others `follow()` runs the passes rank 0 broadcasts. Each rank's share of a pass is
    its model's `forward.stage`, whichever implementation it has (native or MLX's)."""

    def __init__(self, group, model):
        self.group, self.model, self.forward = group, model, model.forward
        try:
            getattr(self.forward, "mlx", self.forward).check_stage()
        except ValueError as e:
            raise PipelineError(f"pipeline stages: {model.flash.fd.architecture} cannot run as one: {e}") from None
        self.rank, self.size = group.rank, group.size
        self.first = self.rank == self.size - 1  # embeds the tokens
        self.hidden = model.args.hidden_size
        self.max_positions = 1 if getattr(model.flash, "dip_layout", False) else MAX_PASS
        if self.rank == 0:  # the generation loop's passes come here (generate._Passes)
            model.forward = self
        self.stats = model.flash.stats
        self.clock = PassClock(self.stats)
        self.waits, self.sends = [], []  # seconds per pass: waiting for the rows before, sending them on
        self.positions = 1  # of the last pass
        self.passes = 0  # exchanges so far, the same count on every rank: each one's number checks it arrived whole
        self.last = time.monotonic()  # of the last exchange
        self.error = None  # rank 0: the PipelineError a pass or ping raised (the pipeline is broken)
        fd = model.flash.fd
        self.layers = (fd.start, fd.stop) if isinstance(fd, StageDir) else (0, len(fd.layers))
        self.name, self.why = f"{self.forward.name}, pipeline stages", self.forward.why
        self.native = self.forward.native
        self.rows_alone = self.sequences_alone = False  # (one sequence at a time through the stages)

    def share_context(self) -> int:
        """Every rank's planned context (`-m -1`: the longest each budget holds) cut to the least, where rank 0's
        generation then stops: no rank's KV cache outgrows its plan."""
        with self.group.watch("agreeing on the context"):
            contexts = mx.distributed.all_gather(
                mx.array([self.model.flash.context], dtype=mx.int64), group=self.group.mx, stream=mx.cpu
            )
            self.model.flash.context = int(np.array(contexts).min())
        return self.model.flash.context

    # -- rank 0: the generation loop's passes --------------------------------------------------------------------
    def __call__(self, tokens, cache, prompt: bool = False) -> mx.array:
        try:
            self._command(PASS, tokens, cache[0].offset, prompt)
            return self._pass(tokens, cache, prompt)
        except PipelineError as e:
            self.error = e
            raise

    def ping(self) -> None:
        """Rank 0, idle (a server between requests): a pass of nothing, at most every quarter of the timeout, so
        that the others' watchdogs hear from it and a rank lost while idle is found."""
        if time.monotonic() - self.last < TIMEOUT / 4:
            return
        try:
            self._command(PING)
        except PipelineError as e:
            self.error = e
            raise

    def stop(self, status: int = 0) -> None:
        """Rank 0: end the other ranks' `follow` (status: rank 0's exit status, which they take)."""
        self._command(STOP, [], 0, False, status)

    # -- the other ranks ----------------------------------------------------------------------------------------
    def follow(self) -> int:
        """Run the passes rank 0 broadcasts until it stops; rank 0's status."""
        cache = self.model.make_cache()
        while True:
            op, tokens, offset, prompt, status = self._command()
            if op == STOP:
                self.stats.end()
                return status
            if op == PING:
                if len(self.stats.tokens) > KEPT:
                    self.stats.reset()
                    del self.waits[:-KEPT], self.sends[:-KEPT]
                continue
            if offset > cache[0].offset:
                raise PipelineError(f"pipeline rank {self.rank}: a pass at offset {offset} past its KV cache")
            for c in cache:  # rank 0 trimmed rejected drafts, or started over
                c.offset = offset
            self._pass(tokens, cache, prompt)
            if prompt:
                give_back()  # (as rank 0's prompt loop does: generate._start)

    # -- both ----------------------------------------------------------------------------------------------------
    def _command(self, op=0, tokens=(), offset=0, prompt=False, status=0):
        """Rank 0's next command, on every rank: the header and up to INLINE tokens in one exchange, a longer pass's
        other tokens in a second."""
        sent = list(tokens)
        buf = np.zeros(HEADER + INLINE, np.int32)
        self.passes += 1
        self.last = time.monotonic()
        if self.rank == 0:
            buf[:HEADER] = op, len(sent), offset, prompt, status, self.passes
            buf[HEADER : HEADER + min(len(sent), INLINE)] = sent[:INLINE]
        what = "sending the next pass" if self.rank == 0 else "waiting for rank 0's next pass"
        # after the last pass's work downstream; the first after rank 0's setup, which may take as long as loading
        limit = self._limit(self.positions) if self.passes > 1 else LOAD_WAITS * TIMEOUT
        with self.group.watch(what, limit):
            buf = np.array(mx.distributed.all_sum(mx.array(buf), group=self.group.mx, stream=mx.cpu))
        op, m, offset, prompt, status, number = (int(v) for v in buf[:HEADER])
        if op == PING:
            self.positions = 1  # no pass downstream to wait for
        # (a ring that lost a peer may fail its pending exchanges with whatever its buffers held, raising nothing)
        if number != self.passes or op not in (PASS, STOP, PING) or not (op != PASS or 0 < m <= MAX_PASS):
            raise PipelineError(f"pipeline rank {self.rank}: {what}: another rank ended or cannot be reached")
        got = buf[HEADER : HEADER + min(m, INLINE)].tolist()
        if m > INLINE:
            rest = np.array(sent[INLINE:] if self.rank == 0 else np.zeros(m - INLINE), np.int32)
            with self.group.watch(what, limit):
                got += np.array(mx.distributed.all_sum(mx.array(rest), group=self.group.mx, stream=mx.cpu)).tolist()
        return op, got, offset, bool(prompt), status

    def _pass(self, tokens, cache, prompt: bool):
        """This rank's share of a forward pass; rank 0 returns the logits. The stats' token is this rank's own work
        (from the rows' arrival to its output), not the waits for the others."""
        self.positions = len(tokens)
        if self.first:
            self.clock.begin(prompt)
            x = list(tokens)
        else:
            start = time.perf_counter()
            what = f"waiting for rank {self.rank + 1}'s hidden rows"
            with self.group.watch(what, self._limit(len(tokens))):
                x = mx.distributed.recv((len(tokens) + 1, self.hidden), mx.float32, self.rank + 1, group=self.group.mx)
                x = np.array(x, copy=True)
            if not np.all(x[-1] == self.passes):  # the pass's number, after the rows: not stale or failed bytes
                raise PipelineError(f"pipeline rank {self.rank}: {what}: another rank ended or cannot be reached")
            x = np.ascontiguousarray(x[:-1])
            self.waits.append(time.perf_counter() - start)
            self.clock.begin(prompt)
        out = self.forward.stage(x, cache, prompt)
        self.clock.done()
        if self.rank == 0:
            return out  # (the logits, evaluated)
        x = out
        start = time.perf_counter()
        with self.group.watch(f"sending the hidden rows to rank {self.rank - 1}"):
            rows = np.concatenate([x, np.full((1, x.shape[1]), self.passes, np.float32)])
            mx.eval(mx.distributed.send(mx.array(rows), self.rank - 1, group=self.group.mx, stream=mx.cpu))
        self.sends.append(time.perf_counter() - start)
        return None

    @staticmethod
    def _limit(positions: int) -> float:
        """How long a wait for the other ranks' share of a pass of `positions` may take: the timeout for a decode
        step, longer for a prompt chunk (each stage reads its units and computes every position)."""
        return TIMEOUT * (1 + positions // 32)

    # -- stats --------------------------------------------------------------------------------------------------
    FIELDS = (
        "start",
        "stop",
        "tokens",
        "device_bytes",
        "bytes_per_token",
        "hit_rate",
        "io_ms",
        "compute_ms",
        "total_ms",
        "wait_ms",
        "send_ms",
        "peak_rss",
        "budget",
    )

    def gather(self) -> Optional[List[dict]]:
        """Every rank's figures (FIELDS; medians over decode passes) on rank 0, None on the others. (float64: exact
        byte counts; the ring backend gathers it, other backends are not tried here.)"""
        s = self.stats.summary()
        plan = self.model.flash.plan
        mine = [
            *self.layers,
            s["tokens"],
            self.stats.device_bytes(),
            s.get("bytes_per_token", 0),
            s.get("hit_rate", 1.0),
            s.get("io_ms", 0),
            s.get("compute_ms", 0),
            s.get("total_ms", 0),
            1e3 * float(np.median(self.waits[-s["tokens"] :])) if self.waits and s["tokens"] else 0,
            1e3 * float(np.median(self.sends[-s["tokens"] :])) if self.sends and s["tokens"] else 0,
            self.stats.peak_rss() or 0,
            plan.budget if plan.budget is not None else -1,
        ]
        with self.group.watch("gathering the stats"):
            rows = np.array(
                mx.distributed.all_gather(mx.array([mine], dtype=mx.float64), group=self.group.mx, stream=mx.cpu)
            )
        return [dict(zip(self.FIELDS, r.tolist())) for r in rows] if self.rank == 0 else None


def print_stages(rows: List[dict], out=sys.stdout) -> None:
    """--stats on rank 0: each rank's layers, bytes, hit rate, I/O and compute per decode token, peak RSS."""
    print("=" * 10 + " pipeline stages (medians per decode token) " + "=" * 10, file=out)
    for rank, r in enumerate(rows):
        print(
            f"rank {rank}: layers {int(r['start'])}-{int(r['stop']) - 1}, "
            f"budget {fmt_bytes(r['budget']) if r['budget'] >= 0 else 'none'}: "
            f"read {fmt_bytes(r['bytes_per_token'])}/token at the device ({fmt_bytes(r['device_bytes'])} in all), "
            f"hit rate {r['hit_rate']:.1%}, io {r['io_ms']:.2f} ms, compute {r['compute_ms']:.2f} ms, "
            f"own work {r['total_ms']:.2f} ms, waiting for the rows {r['wait_ms']:.2f} ms, "
            f"sending them {r['send_ms']:.2f} ms; peak RSS {fmt_bytes(r['peak_rss'])} above the baseline",
            file=out,
        )
    print(
        f"pipeline: {fmt_bytes(sum(r['device_bytes'] for r in rows))} read at the device by all ranks, "
        f"{fmt_bytes(sum(r['bytes_per_token'] for r in rows))}/token",
        file=out,
    )
    print("pipeline stages (JSON): " + json.dumps(rows), file=out)  # for scripts (benchmarks/pipeline_stages.py)
