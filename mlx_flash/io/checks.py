"""Units checked against the checksums convert wrote, the first time each is read in a process.

Corruption on flash (a bad block, a file edited or cut) is found at a unit's first read, before anything computes
with it; a unit read again (evicted, streamed every token) is not checked again, so a long run pays for each unit's
checksum once, whatever the budget. A mismatch raises `ChecksumError`, a `ReadError`: the engine's guard forgets
the rows admitted for the layer, as after any failed read."""

import os
import zlib

import numpy as np

from ..errors import ChecksumError

try:  # the CRC is in the pread pool's extension
    from .. import _pread_pool as _native
except ImportError:  # pragma: no cover - installed without a C compiler
    _native = None

# MLX_FLASH_CHECK_UNITS=0 turns the checks off (to measure what they cost)
CHECK_UNITS = os.environ.get("MLX_FLASH_CHECK_UNITS", "1") != "0"


def crc32_at(src, offsets, length: int) -> np.ndarray:
    """zlib.crc32 of src[o : o + length] for each byte offset o (uint32): natively where the pool is built."""
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    out = np.empty(len(offsets), dtype=np.uint32)
    if _native is not None:
        _native.crc32(src, offsets, length, out)
    else:
        mv = memoryview(src).cast("B")
        out[:] = [zlib.crc32(mv[o : o + length]) for o in offsets.tolist()]
    return out


class UnitChecks:
    """The expected CRC-32 of every unit of a flash directory and which units this process has checked."""

    def __init__(self, fd):
        self.fd = fd
        self.expected = fd.unit_checksums()
        self.checked = {k: np.zeros(len(v), dtype=bool) for k, v in (self.expected or {}).items()}

    def __bool__(self):
        return self.expected is not None

    def check(self, r, units: np.ndarray, buffer, dest: np.ndarray) -> None:
        """Check `units` of region `r` (format.layout.Region), just read to byte offsets `dest` of `buffer`, unless
        checked before."""
        layer, region = r.layer, r.name
        checked = self.checked[layer, region]
        todo = np.flatnonzero(~checked[units])
        if not len(todo):
            return
        got = r.unit_checksums(buffer, dest[todo])
        bad = np.flatnonzero(got != self.expected[layer, region][units[todo]])
        if len(bad):
            raise ChecksumError(
                f"{self.fd.units_where}: checksum mismatch in layer {layer} ({region} unit {units[todo[bad[0]]]}): "
                "the file is corrupted or was replaced; convert the model again"
            )
        checked[units[todo]] = True
