"""Prompt caches on disk: the KV caches of prompts already run, kept in a directory so that a later request, a
restarted server or another process whose prompt starts the same way reads them instead of prefilling again.

One safetensors file an entry (mlx-lm's prompt-cache layout: each cache's state flattened), written to a temporary
name and renamed (a reader never sees half an entry), with what decides whether it may be used in its header: the
model's identity (`identity`: weights, forward, KV cache kind, selector), the tokens, the positions reusable, and a
CRC of the tensors. A file that is truncated, corrupted or from another model is refused, deleted and the prompt
recomputed, never used. The directory is bounded in bytes: the entries used longest ago go first.

Same bits. A prompt's KV comes out of its prefill's chunks. Where the forward computes each row as a pass of its
own (`Forward.rows_alone`: the native dense step) any prefix is reused as it is. Elsewhere (MLX's ops: a product's
rounding depends on its row count) a position's keys depend on the chunk it was computed in, so an entry records
the chunk (`grid`) and how many leading positions were computed in whole chunks of it (`valid`); a prefix is reused
only at the same grid, cut at a whole chunk: the positions after it are prefilled in the chunks a cold run cuts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx

from ..compute import cpu_gemv
from ..format.safetensors_io import TensorSpool, read_header, tensor_bytes

log = logging.getLogger(__name__)

FORMAT = "mlx_flash prompt cache 1"
DEFAULT_BYTES = 8 << 30
# a shorter prefix prefills about as fast as its file reads: not stored
MIN_TOKENS = 64
SUFFIX = ".safetensors"


def identity(model) -> str:
    """What a cached prompt's KV depends on besides its tokens: the weights (the manifest holds their checksums), the
    forward's arithmetic, the KV cache's kind and the selector; a digest."""
    engine = model.flash
    caches = [
        [type(c).__name__, str(getattr(c, "dtype", "")), getattr(c, "bits", None), getattr(c, "group_size", None)]
        for c in model.make_cache()
    ]
    sp = engine.sparsifier
    what = {
        "manifest": hashlib.sha256((engine.fd.path / "flash.json").read_bytes()).hexdigest(),
        "forward": model.forward.name,
        "int8": cpu_gemv.int8_activations(),
        "selector": [sp.name, getattr(sp, "density", None), getattr(sp, "bits", None)],
        "caches": caches,
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:24]


def _layer(cache, i: int) -> list:
    """Layer i's state leaves, (name, value) in order: its arrays cut to the positions held (mlx-lm's KVCache gives its
    whole buffer; keys, values and their quantisation's scales all have the positions second to last)."""
    from mlx.utils import tree_flatten, tree_map

    n = cache.offset
    state = tree_map(lambda a: a[..., :n, :] if isinstance(a, mx.array) and a.ndim >= 3 else a, cache.state)
    return tree_flatten(state, prefix=f".{i}")


CRC_DIGITS = 10  # (the header's room is reserved before the CRC is known)


def _write(tmp: Path, path: Path, cache: list, meta: dict) -> None:
    """The entry's file, a layer's arrays at a time (each spooled to `tmp`, which then becomes `path`)."""
    names, scalars = {}, {}
    for i, c in enumerate(cache):  # (shapes only: MLX's slices and zeros are lazy)
        for k, v in _layer(c, i):
            if isinstance(v, mx.array):
                names[k] = mx.zeros(v.shape, v.dtype)
            else:
                scalars[k] = v
    meta = {**meta, "scalars": json.dumps(scalars), "crc": "0" * CRC_DIGITS}
    spool = TensorSpool(tmp, reserve=names, metadata=meta)
    try:
        crc = zlib.crc32(meta["tokens"].encode())
        for i, c in enumerate(cache):
            for k, v in _layer(c, i):
                if isinstance(v, mx.array):
                    crc = zlib.crc32(tensor_bytes(v).data, crc)
                    spool.add(k, v)
        meta["crc"] = str(crc).zfill(CRC_DIGITS)
        spool.finish(path, list(names), sha256=False)
    finally:
        spool.close()


def _read(entry: "Entry", cache: list) -> list:
    """`cache` (fresh) given the entry's states a layer at a time, checked against its CRC (ValueError)."""
    from mlx.utils import tree_unflatten

    arrays, meta = mx.load(str(entry.path), return_metadata=True)
    classes = json.loads(meta["classes"])
    if classes != [type(c).__name__ for c in cache]:
        raise ValueError(f"caches {classes}, the model's are {[type(c).__name__ for c in cache]}")
    scalars = json.loads(meta["scalars"])
    crc = zlib.crc32(meta["tokens"].encode())
    for i, c in enumerate(cache):
        prefix = f"{i}."
        names = sorted(
            (k for k in (*arrays, *scalars) if k.startswith(prefix)), key=lambda k: [int(x) for x in k.split(".")]
        )
        leaves = []
        for k in names:
            v = arrays.pop(k) if k in arrays else scalars[k]
            if isinstance(v, mx.array):
                crc = zlib.crc32(tensor_bytes(v).data, crc)
            leaves.append((k[len(prefix) :], v))
        c.state = tree_unflatten(leaves)
        _at_capacity(c)
    if crc != int(meta["crc"]):
        raise ValueError("checksum mismatch")
    return cache


def _at_capacity(cache) -> None:
    """A restored cache given the room its plan allocates at the first update (loader.make_cache's `step`), layer by
    layer: the next token would otherwise grow it by another `step` (twice the planned memory, over a hard cap)."""
    from mlx.utils import tree_flatten, tree_map

    room = getattr(cache, "step", 0)
    if hasattr(cache, "make_room"):  # (native_step.HostKVCache: host buffers)
        cache.make_room(room)
        return
    held = getattr(cache, "keys", None)
    if held is None or room <= cache.offset:
        return

    def pad(a):
        return mx.concatenate([a, mx.zeros((*a.shape[:2], room - a.shape[2], a.shape[3]), a.dtype)], axis=2)

    cache.keys, cache.values = tree_map(pad, cache.keys), tree_map(pad, cache.values)
    mx.eval([a for _, a in tree_flatten([cache.keys, cache.values])])


@dataclass
class Entry:
    path: Path
    tokens: List[int]
    grid: int  # the prefill chunk its positions were computed in (1: any)
    valid: int  # leading positions computed in whole chunks of `grid`: the reusable ones
    nbytes: int

    def usable(self, tokens: Sequence[int], grid: int) -> int:
        """The positions of this entry a prompt `tokens` prefilled in chunks of `grid` may take (at least one token
        of the prompt is left to compute: its logits)."""
        if grid != self.grid:
            return 0
        n, most = 0, min(len(tokens) - 1, self.valid)
        while n < most and self.tokens[n] == tokens[n]:
            n += 1
        return n // grid * grid


class PromptStore:
    """The entries of one model (`identity`) under `root` (shared by every model, bounded by `max_bytes` in all)."""

    def __init__(self, root, identity: str, max_bytes: int = DEFAULT_BYTES, min_tokens: int = MIN_TOKENS):
        self.root, self.max_bytes, self.min_tokens = Path(root), max_bytes, min_tokens
        self.dir = self.root / identity
        self.identity = identity
        self.hits = self.misses = self.refused = self.tokens_read = 0

    def _entries(self) -> List[Entry]:
        out = []
        for path in self.dir.glob(f"*{SUFFIX}") if self.dir.is_dir() else ():
            try:
                meta = read_header(path)["__metadata__"]
                if meta.get("format") != FORMAT or meta.get("identity") != self.identity:
                    raise ValueError("not an entry of this model")
                out.append(
                    Entry(path, json.loads(meta["tokens"]), int(meta["grid"]), int(meta["valid"]), path.stat().st_size)
                )
            except FileNotFoundError:  # (evicted by another process meanwhile)
                continue
            except (OSError, ValueError, KeyError, TypeError) as e:
                self._refuse(path, e)
        return out

    def _refuse(self, path: Path, why) -> None:
        log.warning("prompt cache: %s refused (%s): deleted, the prompt is computed", path.name, why)
        self.refused += 1
        path.unlink(missing_ok=True)

    def fetch(self, tokens: Sequence[int], make_cache, grid: int, more_than: int = 0) -> Tuple[Optional[list], int]:
        """(a new cache from `make_cache()` holding the longest stored prefix of `tokens` reusable at `grid`, if longer
        than `more_than`, and its length) or (None, 0). Read a layer at a time: about the cache's own memory."""
        from mlx_lm.models.cache import trim_prompt_cache

        while True:
            best = max(self._entries(), key=lambda e: e.usable(tokens, grid), default=None)
            n = best.usable(tokens, grid) if best is not None else 0
            if n < self.min_tokens or n <= more_than:
                self.misses += 1
                return None, 0
            try:
                cache = _read(best, make_cache())
            except FileNotFoundError:
                continue
            except (OSError, RuntimeError, ValueError, KeyError, TypeError) as e:
                self._refuse(best.path, e)
                continue
            trim_prompt_cache(cache, len(best.tokens) - n)
            os.utime(best.path)  # (the LRU's clock)
            self.hits += 1
            self.tokens_read += n
            return cache, n

    def save(self, tokens: Sequence[int], cache: list, grid: int, valid: Optional[int] = None) -> Optional[Path]:
        """Store `cache` (holding `tokens`; `valid`: its leading positions computed in whole chunks of `grid`, by
        default all of them) unless too short, a layer at a time (little memory beside the cache); entries it extends
        are dropped, then the oldest over the bound. A failed write (a full disk) leaves no file and is logged; the
        caller's work goes on."""
        tokens = [int(t) for t in tokens]
        valid = len(tokens) if valid is None else valid
        if valid < self.min_tokens:
            return None
        key = hashlib.sha256(json.dumps([tokens, grid]).encode()).hexdigest()[:32]
        path = self.dir / f"{key}{SUFFIX}"
        tmp = self.dir / f".{key}.{os.getpid()}.tmp"  # (not an entry's name: no reader opens it)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            _write(tmp, path, cache, {
                "format": FORMAT,
                "identity": self.identity,
                "tokens": json.dumps(tokens),
                "grid": str(grid),
                "valid": str(valid),
                "classes": json.dumps([type(c).__name__ for c in cache]),
            })  # fmt: skip
        except (OSError, RuntimeError) as e:
            log.warning("prompt cache: %d tokens not stored (%s)", len(tokens), e)
            tmp.unlink(missing_ok=True)
            return None
        for e in self._entries():  # a prefix of this one: it reuses no more than this
            if e.path != path and e.grid == grid and e.valid <= valid and tokens[: len(e.tokens)] == e.tokens:
                e.path.unlink(missing_ok=True)
        self._evict()
        return path

    def _evict(self) -> None:
        """The entries of every model under root, oldest used first, until they fit in max_bytes."""
        files = []
        for p in self.root.glob(f"*/*{SUFFIX}"):
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            files.append((st.st_mtime_ns, st.st_size, p))
        total = sum(size for _, size, _ in files)
        for _, size, p in sorted(files):
            if total <= self.max_bytes:
                break
            p.unlink(missing_ok=True)
            total -= size

    def nbytes(self) -> int:
        return sum(p.stat().st_size for p in self.root.glob(f"*/*{SUFFIX}"))
