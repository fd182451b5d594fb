"""Memory budget planner: what stays resident, and how many units each layer's cache holds.

budget = resident weights + KV cache + prompt cache + scratch buffer + workspace + streaming buffers
         + per-layer unit caches.

The prompt cache is room kept for KV caches stored between requests (the server's LRU).

The workspace bounds the runtime's temporaries: the rows gathered for one
chunk of units (at most a scratch buffer's worth) and their float32 copy.
If the resident weights do not fit, the planner streams groups of them from flash
(engine/resident.py: attention layers, embeddings, the LM head, cheapest first) until the rest
does; the streaming buffers hold two loads (the one in use and the prefetched next).
If even that does not fit, loading fails before any weight is read.
"""

import math
import re
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, List, Optional, Union

from .compute import blocks, cpu_gemv
from .engine.native_step import MAX_POSITIONS
from .engine.units import REDUCTION_UNITS
from .errors import BudgetError
from .format import ggml
from .format.config import UNITS, attention_shape, first_of, head_dim
from .io.reader import DEFAULT_THREADS

SCRATCH_BYTES = 16 << 20  # prefill / overflow streaming buffer, shared by all layers
# an MoE model's least workspace, a dense model's usual one (2 x the 16 MiB scratch), or an eighth of a smaller
# model: its scratch is only a token's experts, and besides MLX's temporaries the process has its own while decoding
# (modules imported by the first token, numpy rows, reader threads: 17 MiB measured on a 170 MB model under a hard
# cap)
MIN_MOE_WORKSPACE_BYTES = 2 * SCRATCH_BYTES
# A prompt pass's positions may take this share of the model's bytes (lent by the unit caches while the prompt runs:
# Plan.prompt_loan): a share of the model, not of the budget, so a prompt is cut alike at every budget (the same bits
# where a pass's rounding depends on its row count), and a pass reads each unit once for many positions
PROMPT_SHARE = 1 / 32
# Packed units (format v3) are read through each reader thread's bounce buffer (O_DIRECT wants aligned offsets,
# lengths and addresses): its memory is in the budget, so it is kept small.
FFN_BOUNCE_BYTES = 64 << 10


def parse_size(size: Union[int, float, str, None], total: int = None) -> int:
    """Bytes (at least one) from 123, "2GB", "512MiB", "1.5G" or "50%" (of `total`); ValueError for anything else."""
    if size is None:
        raise ValueError("no size given")
    if isinstance(size, (int, float)):
        value = size
    else:
        s = str(size).strip().upper().replace(" ", "")
        m = re.fullmatch(r"(\d+\.?\d*|\.\d+)(?:(%)|([KMGT]?)I?B?)", s)
        if not m:
            raise ValueError(f"cannot parse size {size!r} (examples: 2GB, 512MiB, 50%)")
        if m.group(2) and total is None:
            raise ValueError(f"{size!r}: a percentage needs a total")
        scale = (
            total / 100 if m.group(2) else {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(3)]
        )
        value = float(m.group(1)) * scale
    if not (math.isfinite(value) and value >= 1):
        raise ValueError(f"size {size!r} is not a positive number of bytes (examples: 2GB, 512MiB, 50%)")
    return int(value)


# --memory-budget auto: of what the machine can give now (io/available.py), a tenth is left for the system and the
# other programs' growth, and AUTO_RESERVE for what the process allocates beyond the plan's parts (the allocator's
# retention, C-level buffers of MLX and the reader, a prompt's activations)
AUTO = "auto"
AUTO_HEADROOM = 0.10
AUTO_RESERVE = 256 << 20


def auto_budget(available: int) -> int:
    """The budget --memory-budget auto takes when the machine can give `available` bytes."""
    return max(0, int(available * (1 - AUTO_HEADROOM)) - AUTO_RESERVE)


def is_auto(size) -> bool:
    return isinstance(size, str) and size.strip().lower() == AUTO


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024


@dataclass
class Plan:
    budget: Optional[int]  # None: no budget
    resident: int
    kv_cache: int
    scratch: int
    workspace: int
    extra: int  # e.g. predictors
    capacity: List[Dict[str, int]]  # per layer: region -> units cached
    streamed: List = field(default_factory=list)  # resident.StreamGroup read from flash every token
    streaming: int = 0  # buffers for the streamed groups
    prefetch_rows: int = 0  # dense decoding: rows of each of the two buffers the next layer's reads go into
    prompt_cache: int = 0  # stored KV caches (the server's LRU prompt cache)
    kv_bits: Optional[int] = None  # None: float KV cache
    max_context: Optional[int] = None  # the longest context the budget could hold (at its floor: see plan_memory)

    def prefill_step(self, fd, context: int, native: bool = False, lend: bool = True) -> int:
        """Prompt tokens per forward pass (mlx-lm's prefill_step_size): as many as the larger of the workspace's room
        (`pass_room`) and PROMPT_SHARE of the model holds (`position_bytes`; what the room does not hold the unit caches
        and read-ahead buffers lend while the prompt runs: `prompt_loan`), unless they hold less than that or `lend` is
        False (the server, whose prompts run beside decode steps, and pipeline stages: the room's); native: the native
        step's passes."""
        most = MAX_POSITIONS if native else 2048  # (longer passes go through MLX's forward)
        per, fixed, room = position_bytes(fd, context, native), pass_bytes(fd, context, native), self.pass_room()
        own = _chunk(min(most, (room - fixed) // per))  # (the workspace's chunk)
        if not lend:
            return own
        step = _chunk(min(most, (max(room, int(fd.model_bytes * PROMPT_SHARE)) - fixed) // per))
        if self.budget is not None and step * per + fixed - room > self.lendable(fd.strides):
            return own  # (a budget at its floor: nothing can lend)
        return step

    def mlx_cache_limit(self) -> int:
        """MLX's cache of freed buffers (mx.set_cache_limit): a quarter of the workspace, the rest for a call's own
        buffers and what MLX does not count."""
        return self.workspace // 4

    def pass_room(self) -> int:
        """The workspace's bytes for a prompt pass's own buffers: besides them MLX keeps the ones a pass freed, up
        to its cache limit, until the pass ends (memory.give_back)."""
        return self.workspace - self.mlx_cache_limit()

    def prompt_loan(self, fd, context: int, native: bool = False, step: Optional[int] = None) -> int:
        """Bytes the unit caches lend while a prompt runs in passes of `step` positions (default `prefill_step`): what
        the passes take beyond the workspace's room (`pass_room`) and the budget's unplanned rest, at most what the
        caches and read-ahead buffers hold; nothing for passes no longer than the workspace's own chunk."""
        step = step or self.prefill_step(fd, context, native)
        if self.budget is None or step <= self.prefill_step(fd, context, native, lend=False):
            return 0
        rest = self.budget - self.nbytes(fd.strides)
        need = step * position_bytes(fd, context, native) + pass_bytes(fd, context, native) - self.pass_room() - rest
        return max(0, min(need, self.lendable(fd.strides)))

    def cache_bytes(self, strides: Dict[str, int]) -> int:
        return sum(c * strides[r] for layer in self.capacity for r, c in layer.items())

    def prefetch_bytes(self, strides: Dict[str, int]) -> int:
        return 2 * self.prefetch_rows * strides.get("neurons", strides.get("experts", 0))

    def lendable(self, strides: Dict[str, int]) -> int:
        """What a prompt can borrow (Plan.prompt_loan): the unit caches and the read-ahead buffers."""
        return self.cache_bytes(strides) + self.prefetch_bytes(strides)

    def nbytes(self, strides: Dict[str, int]) -> int:
        """Everything the plan holds in memory."""
        return (
            self.resident
            + self.kv_cache
            + self.prompt_cache
            + self.scratch
            + self.workspace
            + self.extra
            + self.cache_bytes(strides)
            + self.streaming
            + self.prefetch_bytes(strides)
        )

    def floor(self, strides: Dict[str, int]) -> int:
        """Everything the plan holds but its unit caches: the least a resized plan (`resized`) can take."""
        return self.nbytes(strides) - self.cache_bytes(strides)

    def resized(self, fd, budget: int) -> "Plan":
        """This plan at another budget, for a running model: only its unit caches change (what is resident or
        streamed, the KV caches and the buffers stay). BudgetError below its floor."""
        strides = fd.strides
        floor = self.floor(strides)
        if budget < floor:
            raise BudgetError(
                f"{fmt_bytes(budget)} is below what the running model holds besides its unit caches "
                f"({fmt_bytes(floor)}: resident weights, KV caches, buffers)"
            )
        return replace(self, budget=budget, capacity=split_caches(fd, (budget - floor) // len(fd.layers)))

    def for_forward(self, fd, native: bool) -> "Plan":
        """This plan for the forward the model got (loader.make_forward): with the workspace `fixed_bytes` gives it
        (the native step makes none of MLX's temporaries of GGML blocks), the unit caches larger or smaller by the
        difference. BudgetError where they cannot be smaller."""
        workspace = fixed_bytes(fd, 0, 4, native=native)["workspace"]
        if self.budget is None or workspace == self.workspace:
            return self
        return replace(self, workspace=workspace).resized(fd, self.budget)

    def describe(self, strides: Dict[str, int], units: Dict[str, int]) -> str:
        caps = next((c for c in self.capacity if c), {})  # (an MoE model's first layers may be dense)
        per = ", ".join(f"{caps[r]}/{units[r]} {r}" for r in caps)
        return (
            (f"budget {fmt_bytes(self.budget)}" if self.budget is not None else "no budget")
            + f": resident {fmt_bytes(self.resident)}, "
            f"KV cache {fmt_bytes(self.kv_cache)}"
            + (f" ({self.kv_bits}-bit)" if self.kv_bits else "")
            + ", "
            + (f"prompt cache {fmt_bytes(self.prompt_cache)}, " if self.prompt_cache else "")
            + f"scratch {fmt_bytes(self.scratch)}, workspace {fmt_bytes(self.workspace)}, "
            f"extra {fmt_bytes(self.extra)}, "
            f"unit caches {fmt_bytes(self.cache_bytes(strides))} ({per} per layer)"
            + (
                f", prefetch buffers 2 x {self.prefetch_rows} rows ({fmt_bytes(self.prefetch_bytes(strides))})"
                if self.prefetch_rows
                else ""
            )
            + (
                f"; streamed from flash every token ({fmt_bytes(self.streaming)} of buffers): "
                + describe_streamed(self.streamed)
                if self.streamed
                else ""
            )
            + (
                f"; the budget holds up to {self.max_context} tokens of context (streaming all it can, no unit cached)"
                if self.max_context is not None
                else ""
            )
        )


def _chunk(fits: int) -> int:
    """A prompt chunk of at most `fits` positions, one of a few sizes (2^k, 1.5 * 2^k, at least 16): prompts of other
    lengths cut their chunks alike where a pass's rounding depends on its row count, so a stored prompt's chunks are
    a later one's (engine/prompt_store.py)."""
    return max([16] + [s for k in range(4, 12) for s in (1 << k, 3 << (k - 1)) if s <= fits])


def position_bytes(fd, context: int, native: bool = False) -> int:
    """What a prompt position takes in a pass at most, float32: the residual stream, its norms and q/k/v/o (8 rows of
    the hidden size), the FFN's gate, up and their product (an MoE token's experts'), attention's scores and their
    softmax over `context` keys (MLX's CPU attention composes them from separate ops), and the FFN's partial sums
    (same bits at every budget: a dense layer's sum of each REDUCTION_UNITS ids, an MoE layer's of each expert, held
    until they are added in order; MLX's concatenation of them a second copy, which the native step does not make).
    The native attention keeps one query's scores at a time (`pass_bytes`), so its passes count the scores' term at
    no more than MAX_POSITIONS keys: what its other buffers and the allocator's retention were measured within, and
    a longer context adds nothing a position. Checked against the peak of a chunk on both forwards, after a long
    context too (tests/test_available.py)."""
    config = fd.config
    _, hidden, heads = attention_shape(config)
    top_k, expert = fd.experts_per_token, first_of(config, ("moe_intermediate_size",))
    if top_k and expert:
        ffn = top_k * expert
    else:  # (a dense FFN's blocks of neurons: its experts' together)
        ffn = first_of(config, ("intermediate_size", "ffn_dim")) or 4 * hidden
    partials = top_k or -(-max(r.n_units for r in fd.regions()) // REDUCTION_UNITS)
    keys = min(context, MAX_POSITIONS) if native else context
    return 4 * (8 * hidden + 4 * ffn + 4 * heads * keys + (1 if native else 2) * partials * hidden)


def pass_bytes(fd, context: int, native: bool = False) -> int:
    """What a prompt pass takes whatever its positions: in the native attention, each thread's scores over `context`
    keys and the keys and values of a float16 cache as float32 (kernels/cpu_gemv.c, attention_scratch)."""
    if not native:
        return 0
    return 4 * max(1, cpu_gemv.info().get("threads", 1)) * kv_tokens(context) * (1 + 2 * head_dim(fd.config))


def describe_streamed(groups) -> str:
    layers = [g for g in groups if g.kind == "layer"]
    parts = (
        [f"{len(layers)} attention layers ({fmt_bytes(sum(g.nbytes for g in layers))}, whole, prefetched)"]
        if layers
        else []
    )
    parts += [f"{g.path} ({fmt_bytes(g.nbytes)}, {g.describe()})" for g in groups if g.kind != "layer"]
    return ", ".join(parts)


KV_STEP = 256  # mlx-lm's KVCache grows in steps of this many tokens (the max context is reported in them)
KV_ALIGN = 32


def kv_tokens(context: int) -> int:
    """Tokens a KV cache is allocated for: `context` + 1 (mlx-lm's own loop computes one token ahead) in whole
    KV_ALIGN steps. With a budget each cache is allocated whole, once (loader.make_cache), so a short
    run does not pay for mlx-lm's 256-token steps (256 MiB of float32 KV on a 7B)."""
    return -(-(context + 1) // KV_ALIGN) * KV_ALIGN


def longest_context(config: dict, budget: Optional[int], minimum: Callable[[int], int]) -> int:
    """The context of a run with no token limit. Without a budget, the model's own (max_position_embeddings); under
    one, at most that: the most tokens whose KV cache takes at most half of what the budget leaves above its
    minimum for one token (`minimum(context)`: the smallest budget for a context), so the units keep the other half
    to cache in."""
    config = config.get("text_config", config)  # a multimodal wrapper's language model
    most = config.get("max_position_embeddings") or 4096
    if budget is None:
        return most
    floor = minimum(1)
    room = (budget - floor) // 2
    lo, hi = 1, most  # minimum() grows with the context: the largest that fits, by bisection
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if minimum(mid) - floor <= room else (lo, mid - 1)
    return lo


def kv_cache_bytes(config: dict, context: int, dtype_size: int = 2, bits: int = None, group_size: int = 64) -> int:
    """Keys and values for `context` tokens. With `bits` (mlx-lm's QuantizedKVCache) each head's vector
    is `bits`-bit codes plus a scale and a bias (in the activations' dtype) per `group_size` elements."""
    layers, _, heads = attention_shape(config)
    heads = first_of(config, ("num_key_value_heads",)) or heads
    dim = head_dim(config)
    per_vector = dim * dtype_size if bits is None else dim * bits // 8 + 2 * (dim // group_size) * dtype_size
    return 2 * layers * heads * per_vector * kv_tokens(context)


def fixed_bytes(
    fd,
    context: int,
    dtype_size: int,
    extra: int = 0,
    resident: int = None,
    kv_bits: int = None,
    kv_group_size: int = 64,
    prompt_caches: int = 0,
    sequences: int = 1,
    native: bool = False,
) -> dict:
    """The parts of the budget that do not depend on it: resident, KV cache (of `sequences` decoded together),
    prompt cache, scratch, workspace (`native`: for the native step, which makes none of MLX's temporaries of GGML
    blocks)."""
    # a dense layer's rows; an MoE token's experts (more than that stream through it in turns)
    per_pass = fd.experts_per_call
    scratch = min(
        SCRATCH_BYTES, max(min(r.n_units, per_pass or r.n_units) * fd.layouts[r.name].stride for r in fd.regions())
    )
    scratch += 2 * fd.alignment  # an aligned read's superset of a run of units
    n_buffers = 1 + sum(len(regions) for regions in fd.layers)  # each is padded to the alignment
    kv = kv_cache_bytes(fd.config, context, dtype_size, kv_bits, kv_group_size)
    return {
        "resident": fd.resident_bytes if resident is None else resident,
        "kv_cache": sequences * kv,
        "prompt_cache": prompt_caches * kv,  # each stored cache is one KV cache of `context` tokens
        "scratch": scratch + fd.alignment * n_buffers + bounce_bytes(fd),
        # (MLX's ops gather a decode step's experts' rows, and repack those of GGML blocks: twice that, half for what
        # a call takes, the rest for MLX's cache of freed buffers and what MLX does not count: loader.load)
        "workspace": max(
            2 * scratch,
            min(MIN_MOE_WORKSPACE_BYTES, fd.model_bytes // 8) if per_pass else 0,
            2 * per_pass * max(fd.call_bytes(r.name) for r in fd.regions()) if per_pass and not native else 0,
        )
        + (0 if native else block_temporaries(fd)),
        "extra": extra,
    }


def block_temporaries(fd) -> int:
    """MLX's temporaries of the resident matrices kept as GGML blocks (compute/blocks.py) in its ops: the most a
    layer's take together (its graph holds its projections' at once), or a matrix outside the layers in chunks."""
    index = fd.resident_index()
    per_layer: Dict[str, int] = {}
    for path, kind in fd.blocks.items():
        if f"{path}.weight" not in index:
            continue  # (refused when the model is built: loader._keep_blocks)
        t = ggml.temporary_bytes(kind, index[f"{path}.weight"].nbytes)
        layer = re.search(r"\.layers\.(\d+)\.", path)
        key = layer.group(1) if layer else path
        per_layer[key] = per_layer.get(key, 0) + (t if layer else min(t, blocks.CHUNK_BYTES))
    return max(per_layer.values(), default=0)


def scale_copy_bytes(fd) -> int:
    """The largest float32 copy of a resident matrix's 16-bit scales and biases: MLX's quantised matmul takes them
    in the activations' dtype, so a call with float32 activations copies both (an embedding used as the head: a few
    MiB)."""
    index = fd.resident_index()
    return max(
        (
            2 * 4 * t.nbytes // t.dtype.size
            for name, t in index.items()
            if name.endswith(".scales") and t.dtype.size == 2
        ),
        default=0,
    )


def ffn_reader_threads(fd) -> int:
    """The FFN reader's threads: DEFAULT_THREADS, fewer for a model whose layers are a few bounce buffers long
    (a thread per 64 KiB of a layer's units is all a sweep of it can use)."""
    largest = max(r.nbytes for r in fd.regions())
    return max(4, min(DEFAULT_THREADS, largest // FFN_BOUNCE_BYTES))


def bounce_bytes(fd) -> int:
    """Memory of the FFN reader's bounce buffers: packed units are read through them. (Units read in place as
    their components are, not in windows of whole blocks, bounce too, at most FFN_BOUNCE_BYTES a thread and source
    file, each no larger than a component: a model whose strides allow no windows is a small one.)"""
    return ffn_reader_threads(fd) * FFN_BOUNCE_BYTES if fd.unit_alignment < fd.alignment else 0


def min_budget(
    fd, context: int, dtype_size: int = 4, extra: int = 0, resident: int = None, native: bool = False
) -> int:
    """The smallest budget that keeps every resident weight resident (no FFN unit cached), for the native step's
    forward or MLX's."""
    return sum(fixed_bytes(fd, context, dtype_size, extra, resident, native=native).values())


def with_streamed(fixed: dict, streamed) -> dict:
    """The fixed parts when `streamed` groups leave the resident weights for two loads' buffers."""
    return dict(
        fixed,
        resident=fixed["resident"] - sum(g.nbytes for g in streamed),
        streaming=2 * max((g.load_bytes for g in streamed), default=0),
    )


def min_streaming_budget(fd, context: int, dtype_size: int = 4, extra: int = 0, resident: int = None, groups=()) -> int:
    """The smallest budget that loads at all: every streamable group streamed, no FFN unit cached."""
    return sum(with_streamed(fixed_bytes(fd, context, dtype_size, extra, resident), list(groups)).values())


def _context_held(f: dict, budget: int, context: int, kv_bits: Optional[int] = None) -> str:
    """What a BudgetError adds when a shorter context fits: the longest (its KV caches scale with it), and the
    narrower KV cache there is (`kv_bits`: the one asked)."""
    kv = f["kv_cache"] + f["prompt_cache"]
    per_token = kv / kv_tokens(context)
    if per_token == 0:
        return ""
    held = int((budget - (sum(f.values()) - kv)) // per_token) // KV_ALIGN * KV_ALIGN - 1
    if held < 1:
        return ""
    narrower = {None: ", or --kv-bits 8", 8: ", or --kv-bits 4"}.get(kv_bits, "")
    return f"; it holds a context of at most {held} tokens (a shorter prompt or --max-tokens{narrower})"


def choose_streamed(groups, fixed: dict, budget: int, context: int, always=(), kv_bits: Optional[int] = None):
    """The groups to stream (`always`, then the shortest prefix of the other `groups`, cheapest first, that
    fits; then any of those that fit back are kept resident) and the fixed parts with them. BudgetError if
    none fits (naming the parts of the prefix that needs least: in a small model, streaming a group can take more
    buffer than it frees)."""

    def total(streamed):
        return sum(with_streamed(fixed, streamed).values())

    rest = [g for g in groups if g not in always]
    prefixes = [list(always) + rest[:i] for i in range(len(rest) + 1)]
    streamed = next((p for p in prefixes if total(p) <= budget), None)
    if streamed is None:
        streamed = min(prefixes, key=total)
    f = with_streamed(fixed, streamed)
    if sum(f.values()) > budget:
        raise BudgetError(
            f"memory budget {fmt_bytes(budget)} is too small"
            + (" even with attention, embeddings and LM head streamed from flash: the rest of the" if streamed else ":")
            + f" resident weights {fmt_bytes(f['resident'])} + KV cache for {context} tokens "
            f"{fmt_bytes(f['kv_cache'])}"
            + (f" + prompt cache {fmt_bytes(f['prompt_cache'])}" if f["prompt_cache"] else "")
            + f" + scratch, workspace and streaming buffers "
            f"{fmt_bytes(f['scratch'] + f['workspace'] + f['streaming'])}"
            + (f" + extra {fmt_bytes(f['extra'])}" if f["extra"] else "")
            + f" need {fmt_bytes(sum(f.values()))} before any FFN unit is cached"
            + _context_held(f, budget, context, kv_bits)
        )
    for g in reversed(streamed[len(always) : -1]):  # the last one made it fit
        kept = [s for s in streamed if s is not g]
        if total(kept) <= budget:
            streamed = kept
    return streamed, with_streamed(fixed, streamed)


def every_unit_region(fd) -> Optional[str]:
    """The region of a model whose every unit a dense decode step computes, where it is the only one: a `neurons`
    layout's, or a dense FFN's blocks of neurons (models/blocked.py); else None."""
    if list(fd.layouts) == ["neurons"]:
        return "neurons"
    return "experts" if UNITS in fd.config and list(fd.layouts) == ["experts"] else None


def split_caches(fd, per_layer: int) -> List[Dict[str, int]]:
    """Units each layer's caches hold in `per_layer` bytes, split between its regions by their sizes."""
    capacity = []
    for regions in fd.layers:
        rows = {name: fd.layouts[name].stride for name in regions}  # cache rows are dense (encoded units expanded)
        total = sum(r.n_units * rows[name] for name, r in regions.items())
        capacity.append(
            {
                name: min(r.n_units, int(max(0, per_layer) * r.n_units * rows[name] / total) // rows[name])
                for name, r in regions.items()
            }
        )
    return capacity


def plan_memory(
    fd,
    budget: Optional[int],
    context: int,
    dtype_size: int,
    extra: int = 0,
    resident: int = None,
    groups=(),
    prefetch: bool = False,
    kv_bits: int = None,
    kv_group_size: int = 64,
    prompt_caches: int = 0,
    sequences: int = 1,
    native: bool = False,
) -> Plan:
    """Size the per-layer caches: the remainder after the fixed parts, split by region size.

    `resident`: bytes of the resident weights as loaded (default: their size on disk).
    `groups`: resident.StreamGroup candidates, streamed only if the resident weights do not fit.
    `kv_bits`: a quantised KV cache (`kv_cache_bytes`); `prompt_caches`: room for that many more KV caches,
    stored between requests; `sequences`: KV caches of that many sequences decoded together (the server's batch);
    `native`: the native step's forward (its workspace: `fixed_bytes`; Plan.for_forward once the model is built).
    budget None: no budget (every unit cached).
    `prefetch` (dense decoding of a plain `neurons` layout, or of blocks of neurons: `every_unit_region`): every
    uncached unit is read every token, so two
    buffers of the uncached rows let layer l+1's reads run while layer l computes; they come off the caches:
    L * c + 2 * (n - c) rows fill what is left. Below that (two whole layers do not fit) the caches stay
    empty and the buffers take what is left, the first units of each layer read ahead, the rest on demand."""
    limit = budget if budget is not None else 1 << 62
    fixed = fixed_bytes(
        fd, context, dtype_size, extra, resident, kv_bits, kv_group_size, prompt_caches, sequences, native
    )
    groups = list(groups)
    # an input embedding streamed by rows reads a row per token, and the bytes it frees (past its two loads'
    # buffers) cache FFN units instead: worth it whenever some unit would not be cached
    by_rows = [g for g in groups if g.kind == "rows" and g.nbytes > 2 * g.load_bytes]
    by_rows = by_rows if budget is not None and limit < sum(fixed.values()) + fd.ffn_bytes else []
    region = every_unit_region(fd)
    prefetch = prefetch and region is not None and not fd.layouts[region].encoded and len(fd.layers) > 2
    streamed, f = None, None
    if prefetch and budget is not None and groups:
        # below the resident floor, two whole layers of read-ahead come before resident attention layers: a
        # streamed attention layer adds its bytes to a token's reads, where reads not overlapped with compute
        # add their whole time
        whole = dict(fixed, prefetch=2 * fd.layers[0][region].n_units * fd.layouts[region].stride)
        try:
            streamed, f = choose_streamed(groups, whole, limit, context, always=by_rows, kv_bits=kv_bits)
            f.pop("prefetch")
        except BudgetError:
            pass
    if f is None:
        streamed, f = choose_streamed(groups, fixed, limit, context, always=by_rows, kv_bits=kv_bits)
    left = limit - sum(f.values())
    per_layer = left // len(fd.layers)
    prefetch_rows = 0
    if prefetch:
        n, s, L = fd.layers[0][region].n_units, fd.layouts[region].stride, len(fd.layers)
        c = (left - 2 * n * s) // ((L - 2) * s)  # cached rows per layer
        if 0 <= c < n:
            per_layer, prefetch_rows = c * s, n - c
        elif c < 0 and left >= 2 * s:  # a row held ahead costs 2 rows of memory, a cached one L: all to the buffers
            per_layer, prefetch_rows = 0, left // (2 * s)
    capacity = split_caches(fd, per_layer)
    max_context = None
    if budget is not None:  # the KV cache could take everything but the floor (all streamable streamed, no unit cached)
        floor = with_streamed(fixed, groups)
        per_step = kv_cache_bytes(fd.config, KV_STEP, dtype_size, kv_bits, kv_group_size)
        room = budget - sum(floor.values()) + floor["kv_cache"] + floor["prompt_cache"]
        max_context = room // ((sequences + prompt_caches) * per_step) * KV_STEP
    return Plan(
        budget,
        f["resident"],
        f["kv_cache"],
        f["scratch"],
        f["workspace"],
        extra,
        capacity,
        streamed,
        f["streaming"],
        prefetch_rows,
        f["prompt_cache"],
        kv_bits,
        max_context,
    )
