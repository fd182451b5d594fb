"""Per-token runtime statistics, collected by the runtime itself (cheap: a few counters per layer)."""

import time
from dataclasses import dataclass, field
from typing import List

import numpy as np

from ..io.memory import peak_rss


@dataclass
class TokenStats:
    io_s: float = 0.0  # waiting for reads from flash
    mm_s: float = 0.0  # memory management: cache planning, row moves, copies
    expand_s: float = 0.0  # expanding encoded (bitmap) units read into dense rows
    total_s: float = 0.0  # wall time of the whole token (set by the generate loop)
    bytes_read: int = 0  # read at the device by the runtime's readers (gap fills and alignment included)
    busy_s: float = 0.0  # time the readers had reads in flight (summed over readers)
    bytes_requested: int = 0  # the bytes asked for: FFN units and streamed resident weights
    streamed_bytes: int = 0  # of which resident weights streamed below the resident floor (engine/resident.py)
    hits: int = 0
    misses: int = 0
    active: List[int] = field(default_factory=list)  # active units per layer (summed over regions)
    ahead_bytes: int = 0  # read ahead (read_ahead.py): bytes read for the next layer's expected units
    ahead_wasted_bytes: int = 0  # of which units the layer did not need (or no layer took)
    routed: int = 0  # experts routed in layers that had a prediction
    predicted: int = 0  # of which the prediction had
    syncs: int = 0  # times the pass waited for MLX's lazy graph (a host synchronisation: on a GPU, a stall)
    waits: int = 0  # times it waited for a result already queued (a streamed buffer's fence: engine/resident.py)
    prefill: bool = False

    @property
    def compute_s(self) -> float:
        return max(0.0, self.total_s - self.io_s - self.mm_s - self.expand_s)

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 1.0


class Stats:
    """Accumulates TokenStats; `begin_token()` starts a new one, the runtime adds to `current`.

    The runtime marks token boundaries itself: the first event of a forward pass (`touch`: an
    embedding lookup, a streamed attention layer or an FFN) begins a token, the last layer's FFN
    ends the pass (`forward_done`); LM head reads after it still count for that token.

    `readers`: the reader.py pools whose `bytes_read` counters (what they read from the file, gaps and
    alignment supersets included: with O_DIRECT, the bytes at the device) give each token's bytes_read."""

    def __init__(self, readers=()):
        self.readers = list(readers)
        self.baseline_rss = None  # set by loader.load: the process RSS the budget is above
        self.tokens: List[TokenStats] = []
        self.current = TokenStats()
        self._t0 = None
        self._read0 = self._busy0 = 0
        self._between_forwards = True

    def device_bytes(self) -> int:
        return self._counters()[0]

    def _counters(self):
        """(bytes read at the device, seconds with reads in flight), summed over the readers."""
        stats = [r.stats() for r in self.readers]
        return sum(s["bytes_read"] for s in stats), sum(s.get("busy_ns", 0) for s in stats) / 1e9

    def _close(self, now: float):
        read, busy = self._counters()
        self.current.total_s = now - self._t0
        self.current.bytes_read = read - self._read0
        self.current.busy_s = busy - self._busy0
        self.tokens.append(self.current)
        self._read0, self._busy0 = read, busy

    def touch(self, prefill: bool):
        if self._between_forwards:
            self.begin_token(prefill)
            self._between_forwards = False

    def forward_done(self):
        self._between_forwards = True

    def begin_token(self, prefill: bool = False):
        now = time.perf_counter()
        if self._t0 is not None:
            self._close(now)
        else:
            self._read0, self._busy0 = self._counters()
        self.current = TokenStats(prefill=prefill)
        self._t0 = now

    def end(self):
        """Close the token in progress."""
        if self._t0 is not None:
            self._close(time.perf_counter())
            self._t0 = None
            self.current = TokenStats()
        self._between_forwards = True

    def reset(self):
        baseline = self.baseline_rss
        self.__init__(self.readers)
        self.baseline_rss = baseline

    def peak_rss(self):
        """Peak RSS of the process above the baseline `load` recorded (None without one)."""

        return None if self.baseline_rss is None else peak_rss() - self.baseline_rss

    def decode_tokens(self) -> List[TokenStats]:
        return [t for t in self.tokens if not t.prefill]

    def summary(self) -> dict:
        toks = self.decode_tokens()
        if not toks:
            return {"tokens": 0}

        def med(f):
            return float(np.median([f(t) for t in toks]))

        hits, misses = sum(t.hits for t in toks), sum(t.misses for t in toks)
        return {
            "tokens": len(toks),
            "io_ms": med(lambda t: t.io_s * 1e3),
            "mm_ms": med(lambda t: t.mm_s * 1e3),
            "expand_ms": med(lambda t: t.expand_s * 1e3),
            "compute_ms": med(lambda t: t.compute_s * 1e3),
            "total_ms": med(lambda t: t.total_s * 1e3),
            "total_ms_p10": float(np.percentile([t.total_s * 1e3 for t in toks], 10)),
            "total_ms_p90": float(np.percentile([t.total_s * 1e3 for t in toks], 90)),
            "bytes_per_token": float(np.mean([t.bytes_read for t in toks])),
            # the readers' throughput while they had reads in flight (compare with fio at the request size)
            "read_bytes_per_s": (
                sum(t.bytes_read for t in toks) / sum(t.busy_s for t in toks)
                if sum(t.busy_s for t in toks) > 0
                else None
            ),
            "bytes_requested_per_token": float(np.mean([t.bytes_requested for t in toks])),
            "streamed_bytes_per_token": float(np.mean([t.streamed_bytes for t in toks])),
            "hit_rate": hits / (hits + misses) if hits + misses else 1.0,
            "peak_rss_bytes": self.peak_rss(),
            "active_per_layer": float(np.mean([np.mean(t.active) for t in toks if t.active]))
            if toks[0].active
            else 0.0,
            "prediction_accuracy": (
                sum(t.predicted for t in toks) / sum(t.routed for t in toks) if sum(t.routed for t in toks) else None
            ),
            "ahead_bytes_per_token": float(np.mean([t.ahead_bytes for t in toks])),
            "ahead_wasted_bytes_per_token": float(np.mean([t.ahead_wasted_bytes for t in toks])),
            "syncs_per_token": float(np.median([t.syncs for t in toks])),
            "waits_per_token": float(np.median([t.waits for t in toks])),
        }

    @staticmethod
    def format_token(i: int, t: TokenStats) -> str:
        return (
            f"[token {i:4d}] io {t.io_s * 1e3:7.2f} ms | mm {t.mm_s * 1e3:6.2f} ms | "
            + (f"expand {t.expand_s * 1e3:6.2f} ms | " if t.expand_s else "")
            + f"compute {t.compute_s * 1e3:7.2f} ms | read {t.bytes_read / 2**20:7.2f} MiB "
            f"(asked {t.bytes_requested / 2**20:.2f})"
            + (f" ({t.streamed_bytes / 2**20:.2f} streamed)" if t.streamed_bytes else "")
            + f" | hit {t.hit_rate:6.1%} | active/layer {np.mean(t.active) if t.active else 0:7.1f}"
            + (
                f" | ahead {t.ahead_bytes / 2**20:.2f} MiB ({t.ahead_wasted_bytes / 2**20:.2f} unused), "
                f"predicted {t.predicted / t.routed:.1%}"
                if t.routed
                else ""
            )
        )
