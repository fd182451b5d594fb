"""Below the resident floor: stream attention layers and the embedding / LM head from flash too.

When a budget cannot hold every resident weight, the planner (budget.plan_memory) streams
the groups `stream_groups` lists, cheapest first, until the rest fits:

    rows    an untied input embedding (OPT's position embedding too): only the rows of the
            tokens being embedded are read, so streaming it costs almost no I/O
    layer   a module of one layer other than its FFN (its attention of whatever kind, a
            convolution, ...), read whole every token; layers are taken evenly spread, so the
            resident layers between streamed ones give the prefetch compute to hide behind
    head    the LM head, or a tied embedding used as one: read every token in chunks of
            vocabulary rows, so it never needs more than two chunks of memory (logits for
            several positions at once are left lazy: see StreamedRows._chunked)

A `ResidentStreamer` reads them from resident.safetensors (offsets from its header, so the
format needs nothing new) with its own pread pool. Loads follow the order of the forward
pass (layer groups by index, then the head's chunks) and each starts the read of the next
one once its own compute is queued (mx.async_eval; the native step's, at once), as offloading
systems prefetch layer l+1 while layer l computes: at most two loads are in memory at once.
A buffer's next read first waits for the last result computed from it (its fence), so a
streamed module costs no host synchronisation of its own: a head chunk's wait finds the next
chunk queued behind it (on a GPU, no stall), and a streamed layer's was computed by the FFN's
synchronisations since. Reads are aligned supersets of each tensor's bytes (O_DIRECT) into one
aligned buffer; the tensors are views of it, cast to float32 where the resident weights would
be (loader.cpu_float32).

Wrappers take the streamed modules' places in the model, holding the original module (its
class does the maths) with placeholder weights between calls; `Absent` takes the place of a module
a pipeline stage does not hold (models/stage.py).
"""

import time
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from ..io.reader import aligned_buffer, aligned_span
from .experts import SWITCHES

HEAD_CHUNK_BYTES = 2 << 20  # LM head rows per streamed chunk: large reads, little memory
STREAM_THREADS = 8  # a few large reads per load
EMBEDDINGS = (nn.Embedding, nn.QuantizedEmbedding)
LINEARS = (nn.Linear, nn.QuantizedLinear)


@dataclass
class StreamGroup:
    """A module the planner may stream: its path in the model, kind, tensors and bytes in memory."""

    path: str  # e.g. "model.layers.3.self_attn"
    kind: str  # "rows", "layer" or "head" (module doc)
    tensors: List[str]  # full names in resident.safetensors
    nbytes: int  # in memory when resident (after the float32 cast)
    load_bytes: int  # memory one load of it takes while streamed
    chunk_rows: int = 0  # head: vocabulary rows per chunk

    def describe(self) -> str:
        return {"rows": "rows on lookup", "layer": "whole, prefetched", "head": f"in chunks of {self.chunk_rows} rows"}[
            self.kind
        ]


def _spread(n: int) -> List[int]:
    """0..n-1 in bit-reversed order: every prefix is spread evenly over the range."""
    bits = max(1, (n - 1).bit_length())
    return sorted(range(n), key=lambda i: int(f"{i:0{bits}b}"[::-1], 2))


def _group(path: str, kind: str, tensors, cast, alignment: int, rows: Optional[int] = None, chunk: int = 0):
    """A StreamGroup whose one load holds `rows` rows of each tensor (None: whole tensors): the
    aligned read buffer (each range padded to the alignment at both ends: one range per tensor,
    or per row for lookups) plus float32 copies."""
    load = alignment
    for t in tensors:
        frac = 1.0 if rows is None else min(1.0, rows / t.shape[0])
        cast_copy = t.nbytes_as(cast) if t.nbytes_as(cast) != t.nbytes else 0
        load += int((t.nbytes + cast_copy) * frac) + 2 * alignment * (rows if kind == "rows" else 1)
    return StreamGroup(path, kind, [t.name for t in tensors], sum(t.nbytes_as(cast) for t in tensors), load, chunk)


def stream_groups(fd, model: nn.Module, cast=None, context: int = 2048) -> List[StreamGroup]:
    """The modules that may be streamed, in the order the planner streams them (module doc). What a module is
    comes from its type in `model`, mlx-lm's model of the directory's config (lazy weights: nothing is read;
    models.inspect.instantiate), not its name:

    an embedding (nn.Embedding, quantised or not) is read by rows; the head, in chunks, if no linear layer outside
    the layers maps to a vocabulary (tied: then the token embedding, the first one defined);
    a linear layer outside the layers is read in chunks as a head;
    each child of a layer holding matrices is read whole (attention of any kind, with its norms and sinks: MLA's
    embed_q / unembed_out, linear attention, convolutions, a dense FFN the engine does not stream), but not the
    module holding the experts (router and shared experts stay resident) nor a dense FFN streamed as units."""
    index = fd.resident_index()
    by_module: Dict[str, list] = {}
    for name, t in index.items():
        by_module.setdefault(name.rsplit(".", 1)[0], []).append(t)
    names = {id(m): p for p, m in model.named_modules()}
    layers = [names[id(layer)] for layer in model.layers]
    outside = [
        (p, m) for p, m in model.named_modules() if p in by_module and not any(p.startswith(q + ".") for q in layers)
    ]
    embeddings = [p for p, m in outside if isinstance(m, EMBEDDINGS)]
    linears = [p for p, m in outside if isinstance(m, LINEARS)]
    vocabularies = {by_module[p][0].shape[0] for p in embeddings}
    untied = any(by_module[p][0].shape[0] in vocabularies for p in linears)  # a linear head, as many rows as one
    order = {p: i for i, (p, _) in enumerate(tree_flatten(model.parameters()))}
    tied = [] if untied or not embeddings else [min(embeddings, key=lambda p: order[p + ".weight"])]  # tokens': first
    tied = tied if getattr(fd, "last", True) else []  # a pipeline stage before the last holds no head (models/stage.py)

    rows, heads = [], []
    for path in tied + linears:
        ts = by_module[path]
        vocab = ts[0].shape[0]
        chunk = max(1, min(vocab, int(HEAD_CHUNK_BYTES * vocab // sum(t.nbytes_as(cast) for t in ts))))
        heads.append(_group(path, "head", ts, cast, fd.alignment, rows=chunk, chunk=chunk))
    for path in (p for p in embeddings if p not in tied):
        ts = by_module[path]
        rows.append(_group(path, "rows", ts, cast, fd.alignment, rows=min(context, ts[0].shape[0])))
    ffn = set(fd.ffn.get("mlp_paths", ()))
    layer_groups = []
    for i in _spread(len(layers)):
        for name, child in tree_flatten(model.layers[i].children(), is_leaf=nn.Module.is_module):
            path = f"{layers[i]}.{name}"  # (a list of blocks, as longcat_flash's two attentions: one each)
            ts = [t for n, t in index.items() if n.startswith(path + ".")]
            if path in ffn or _holds_experts(child):
                continue
            if any(len(t.shape) > 1 for t in ts):  # (norms alone stay resident: too small to be worth a read)
                layer_groups.append(_group(path, "layer", ts, cast, fd.alignment))
    return rows + layer_groups + heads


def _holds_experts(module: nn.Module) -> bool:
    return any(isinstance(m, SWITCHES) for _, m in module.named_modules())


# -- reading -------------------------------------------------------------------------------

Ranges = List[Tuple[int, int]]  # (file offset, length) per tensor


class _Load:
    """One submitted read: the aligned buffer, where each tensor landed, and the pool handle."""

    def __init__(self, key, reader, tensors, ranges: Sequence[Ranges], shapes, cast, file_size: int, buffers):
        """buffers(nbytes) -> (an evaluated uint8 mx.array, the offset of its first aligned byte) to read into."""
        a = reader.alignment
        offsets, lengths, dests, self.parts = [], [], [], []
        pos = 0
        for t, rs, shape in zip(tensors, ranges, shapes):
            spans = []
            for off, n in rs:
                lo, hi = aligned_span(off, n, a)
                hi = min(hi, file_size)
                offsets.append(lo), lengths.append(hi - lo), dests.append(pos)
                spans.append((pos + off - lo, n))
                pos += -(-(hi - lo) // a) * a
            self.parts.append((t, spans, shape))
        self.key, self.cast, self.nbytes = key, cast, sum(n for rs in ranges for _, n in rs)
        self.buffer, base = buffers(max(pos, 1))
        dests = np.asarray(dests, np.int64) + base
        self.base = base
        self.handle = reader.submit(self.buffer, np.asarray(offsets, np.int64), np.asarray(lengths, np.int64), dests)

    def arrays(self, reader) -> Dict[str, mx.array]:
        """Wait for the read; the tensors as views of the buffer (float32 copies where cast)."""
        reader.wait(self.handle)
        out = {}
        for t, spans, shape in self.parts:
            pieces = [mx.view(self.buffer[self.base + p : self.base + p + n], t.dtype) for p, n in spans]
            a = (pieces[0] if len(pieces) == 1 else mx.concatenate(pieces)).reshape(shape)
            out[t.name] = a.astype(t.loaded_dtype(self.cast))
        return out


class ResidentStreamer:
    """Reads streamed groups from resident.safetensors, prefetching the next load of the forward pass."""

    def __init__(self, fd, reader, groups: List[StreamGroup], cast=None, stats=None):
        self.fd, self.reader, self.cast, self.stats = fd, reader, cast, stats
        self.index = fd.resident_index()
        self.file_size = fd.resident_bytes
        self.groups = {g.path: g for g in groups}
        layers = sorted((g for g in groups if g.kind == "layer"), key=lambda g: _layer_number(g.path))
        # the forward order of whole loads: attention layers, then each head's chunks
        self.schedule = [(g.path, None) for g in layers]
        self.schedule += [(g.path, rows) for g in groups if g.kind == "head" for rows in self.chunks(g.path)]
        self._next = {k: self.schedule[(i + 1) % len(self.schedule)] for i, k in enumerate(self.schedule)}
        self.pending: Optional[_Load] = None
        # the loads' buffers, kept (the plan's streaming buffers, made now): the one in use and the next one's, then
        # a lookup's rows (grown as one needs)
        largest = max((g.load_bytes for g in groups if g.kind != "rows"), default=0)
        self._buffers = [aligned_buffer(largest, reader.alignment) if largest else None for _ in range(2)] + [None]
        self._fences: List[Optional[mx.array]] = [None] * 3  # each buffer's last result computed from it
        self._turn = 0
        self._current = 0  # the buffer of the last load taken
        self._ahead = None  # the key whose next load done() reads ahead

    def _buffer(self, which: int):
        """buffers() for a load into buffer `which` (0 and 1 in turn for the schedule's loads, 2 for lookups), once
        what was computed from its last load is."""
        fence, self._fences[which] = self._fences[which], None
        if fence is not None:
            mx.eval(fence)
            if self.stats is not None:
                self.stats.current.waits += 1

        def get(nbytes: int):
            held = self._buffers[which]
            if held is None or held[0].size - held[1] < nbytes:
                held = self._buffers[which] = aligned_buffer(nbytes, self.reader.alignment)
            return held

        return get

    def _submit(self, key) -> _Load:
        """Start reading a whole group (rows None) or rows [r0, r1) of each of its tensors, into the buffer the last
        load did not take."""
        path, rows = key
        tensors = [self.index[n] for n in self.groups[path].tensors]
        ranges, shapes = [], []
        for t in tensors:
            r0, r1 = rows or (0, t.shape[0])
            row = t.nbytes // t.shape[0]
            ranges.append([(t.offset + r0 * row, (r1 - r0) * row)])
            shapes.append((r1 - r0, *t.shape[1:]))
        self._turn ^= 1
        load = _Load(key, self.reader, tensors, ranges, shapes, self.cast, self.file_size, self._buffer(self._turn))
        load.which = self._turn
        return load

    def _take(self, load: _Load) -> Dict[str, mx.array]:
        t = time.perf_counter()
        arrays = load.arrays(self.reader)
        if self.stats is not None:
            s = self.stats.current
            s.io_s += time.perf_counter() - t
            s.bytes_requested += load.nbytes
            s.streamed_bytes += load.nbytes
        return arrays

    def load(self, path: str, rows: Optional[Tuple[int, int]] = None, ahead: bool = True) -> Dict[str, mx.array]:
        """The tensors of a layer group or a head chunk; starts reading the next load before returning (ahead), or
        at done(), once what they compute is queued."""
        key = (path, rows)
        load, self.pending = self.pending, None
        if load is not None and load.key != key:  # off schedule (e.g. an aborted forward): drop it
            self.reader.wait(load.handle)
            load = None
        if load is None:
            load = self._submit(key)
        self._ahead = key
        if ahead:
            self._read_ahead()
        self._current = load.which
        return self._take(load)

    def _read_ahead(self):
        nxt, self._ahead = self._next.get(self._ahead), None
        if nxt is not None:
            self.pending = self._submit(nxt)

    def done(self, out):
        """Queues what the last load's (or lookup's) tensors compute, fences their buffer with it, and starts the
        next read."""
        mx.async_eval(out)
        self._fences[self._current] = out
        self._read_ahead()

    def rows(self, path: str, ids: np.ndarray) -> Dict[str, mx.array]:
        """Rows `ids` (sorted, unique) of every tensor of a group, read now."""
        tensors = [self.index[n] for n in self.groups[path].tensors]
        ranges, shapes = [], []
        for t in tensors:
            row = t.nbytes // t.shape[0]
            ranges.append([(t.offset + int(i) * row, row) for i in ids])
            shapes.append((len(ids), *t.shape[1:]))
        load = _Load((path, "rows"), self.reader, tensors, ranges, shapes, self.cast, self.file_size, self._buffer(2))
        self._ahead, self._current = None, 2
        return self._take(load)

    def touch(self, x: mx.array):
        """A streamed embedding or attention layer may be where a token's forward pass starts."""
        if self.stats is not None:
            self.stats.touch(prefill=x.size > x.shape[-1] if mx.issubdtype(x.dtype, mx.floating) else x.size > 1)

    def lazy(self, path: str) -> Dict[str, mx.array]:
        """The group's tensors as lazily loaded arrays (mx.load): read whole, and only if evaluated."""
        arrays = self.fd.load_resident(biases=False)  # as stored: what the groups list
        out = {}
        for name in self.groups[path].tensors:
            out[name] = arrays[name].astype(self.index[name].loaded_dtype(self.cast))
        return out

    def chunks(self, path: str) -> List[Tuple[int, int]]:
        """A head's chunks of vocabulary rows, [r0, r1)."""
        vocab, n = self.index[self.groups[path].tensors[0]].shape[0], self.groups[path].chunk_rows
        return [(r, min(r + n, vocab)) for r in range(0, vocab, n)]

    def close(self):
        if self.pending is not None:
            try:
                self.reader.wait(self.pending.handle)
            finally:
                self.pending = None
        self.reader.close()


def _layer_number(path: str) -> int:
    for part in path.split("."):
        if part.isdigit():
            return int(part)
    return 0


# -- modules -----------------------------------------------------------------------------


class Streamed(nn.Module):
    """Holds the original module (hidden from parameters(): its weights are not resident)."""

    @property
    def inner(self) -> nn.Module:
        """The original module, with placeholder weights outside `loaded`."""
        return self._inner

    @contextmanager
    def loaded(self, rows: Optional[Tuple[int, int]] = None):
        """The original module with its weights (`rows`: a head's chunk of them) read, for the duration."""
        self._use(self._streamer.load(self._path, rows))
        try:
            yield self._inner
        finally:
            self._release()

    def chunks(self) -> List[Tuple[int, int]]:
        """The chunks of rows a streamed head is read in."""
        return self._streamer.chunks(self._path)

    def __init__(self, inner: nn.Module, streamer: ResidentStreamer, path: str):
        super().__init__()
        self._inner, self._streamer, self._path = inner, streamer, path
        self._prefix = path + "."
        # empty stand-ins between calls, made once: the loaded weights are freed after each output
        self._placeholders = tree_map(lambda a: mx.zeros((0,), a.dtype), inner.parameters())
        self._release()

    def __getattr__(self, key: str):
        """The original module's other attributes, as the model reads them (e.g. make_cache: a layer's kind)."""
        try:
            return super().__getattr__(key)
        except AttributeError:
            if key.startswith("_"):
                raise
            return getattr(self._inner, key)

    def _use(self, arrays: Dict[str, mx.array]):
        self._inner.update(tree_unflatten([(k[len(self._prefix) :], v) for k, v in arrays.items()]))

    def _release(self):
        self._inner.update(self._placeholders)

    def _run(self, arrays, fn):
        self._use(arrays)
        try:
            out = fn()
        finally:
            self._release()
        self._streamer.done(out)
        return out


class StreamedLayer(Streamed):
    """A whole module (a layer's attention) read for each call."""

    def __call__(self, x, *args, **kwargs):
        self._streamer.touch(x)
        return self._run(self._streamer.load(self._path, ahead=False), lambda: self._inner(x, *args, **kwargs))


# Set where a pass's logits of several positions are all used (a speculative verification): the head then streams
# in its chunks, as for one position, rather than read whole
EVERY_ROW = ContextVar("every_row", default=False)


class StreamedRows(Streamed):
    """An embedding (or LM head): lookups read only the rows asked for; as a linear layer
    (an LM head, or a tied embedding's `as_linear`) it is read in chunks of rows."""

    def __call__(self, x: mx.array) -> mx.array:
        if mx.issubdtype(x.dtype, mx.integer):  # an embedding lookup
            self._streamer.touch(x)
            ids, inverse = np.unique(np.array(x), return_inverse=True)
            arrays = self._streamer.rows(self._path, ids)
            return self._run(arrays, lambda: self._inner(mx.array(inverse.reshape(x.shape).astype(np.int32))))
        return self._chunked(x, lambda: self._inner(x))

    def as_linear(self, x: mx.array) -> mx.array:
        return self._chunked(x, lambda: self._inner.as_linear(x))

    def _chunked(self, x: mx.array, fn: Callable[[], mx.array]) -> mx.array:
        if x.size > x.shape[-1] and not EVERY_ROW.get():
            # Several positions: a prompt, whose logits mlx-lm never evaluates (only the last
            # token's, in a call of its own). Left lazy they cost nothing; if evaluated (e.g. a
            # perplexity run), the head is read whole, outside the streaming buffers.
            self._use(self._streamer.lazy(self._path))
            out = fn()
            self._release()
            return out
        parts = [
            self._run(self._streamer.load(self._path, rows, False), fn) for rows in self._streamer.chunks(self._path)
        ]
        return mx.concatenate(parts, axis=-1)


class Absent(nn.Module):
    """A module another pipeline stage holds (no weights). In this stage's pass a norm or head it lacks passes the
    rows on as they are (the stage before the last sends the rows of its last layer); a lookup in an embedding it
    lacks is a bug, said plainly (the stage's pass gives its layers the rows the stage before sent)."""

    def __init__(self, path: str):
        super().__init__()
        self._path = path

    def __call__(self, x, *args, **kwargs):
        if not mx.issubdtype(x.dtype, mx.floating):
            raise RuntimeError(f"{self._path} is held by another pipeline stage")
        return x

    def as_linear(self, x):
        return x


def wrapper_for(group: StreamGroup) -> Callable[[nn.Module, ResidentStreamer], nn.Module]:
    cls = StreamedLayer if group.kind == "layer" else StreamedRows
    return lambda module, streamer: cls(module, streamer, group.path)
