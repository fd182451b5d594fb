"""What the machine can give this process now: the memory `--memory-budget auto` plans in.

    Linux   the least of MemAvailable (/proc/meminfo: free memory and the page cache the kernel can drop) and, for
            the process's memory cgroup and each one above it, its limit less what it holds that cannot be dropped
            (v2 memory.max - memory.current + inactive_file; v1 memory.limit_in_bytes - memory.usage_in_bytes +
            total_inactive_file): a container's or `tools/cap`'s hard cap is the machine such a process has.
    macOS   the reclaimable memory (host_statistics64: free, inactive, purgeable and speculative pages) and, where
            MLX computes on Metal, the GPU's recommended working set less what MLX holds.

Each probe that answers is a `Limit`; the least of them is what the process can take, shared with the other ranks
of an mlx.launch on the same machine (its ring hostfile names each rank's addresses).
"""

import ctypes
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

MEMINFO = Path("/proc/meminfo")
SELF_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")
UNLIMITED = 1 << 60  # a cgroup limit at or above this is no limit (v1 writes 2^63 rounded to a page)


@dataclass
class Limit:
    what: str  # where it was read, for --stats
    bytes: int


@dataclass
class Available:
    limits: List[Limit] = field(default_factory=list)
    ranks: int = 1  # processes of one launch on this machine, sharing it

    @property
    def bytes(self) -> Optional[int]:
        """This process's share of the least the probes allow; None where no probe answered."""
        least = min((lim.bytes for lim in self.limits), default=None)
        return None if least is None else least // self.ranks

    def describe(self) -> str:
        if not self.limits:
            return "no probe of this system's free memory answered"
        found = ", ".join(f"{lim.what} {lim.bytes / (1 << 20):.0f} MiB" for lim in self.limits)
        return found + (f"; shared by the {self.ranks} ranks of a launch on this machine" if self.ranks > 1 else "")


def ranks_here(environ=os.environ) -> int:
    """The ranks of an mlx.launch (ring backend) on this rank's machine: those whose addresses' hosts are its own."""
    try:
        nodes = json.loads(Path(environ["MLX_HOSTFILE"]).read_text())
        hosts = [{address.rsplit(":", 1)[0] for address in node} for node in nodes]
        return max(1, sum(h == hosts[int(environ.get("MLX_RANK", 0))] for h in hosts))
    except (KeyError, OSError, ValueError, IndexError, TypeError, AttributeError):
        return 1


def _read_int(path: Path) -> Optional[int]:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return UNLIMITED if text == "max" else int(text) if text.isdigit() else None


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def meminfo(path: Path = MEMINFO) -> Optional[Limit]:
    for line in path.read_text().splitlines() if path.exists() else ():
        if line.startswith("MemAvailable:"):
            return Limit("MemAvailable", int(line.split()[1]) * 1024)
    return None


def _cgroup_dirs(self_cgroup: Path, root: Path):
    """(version, directory) of this process's memory cgroup and each one above it, innermost first."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            version, base = 1, root / "memory"
        elif controllers == "" and (root / "cgroup.controllers").exists():
            version, base = 2, root
        elif controllers == "" and (root / "unified" / "cgroup.controllers").exists():
            version, base = 2, root / "unified"
        else:
            continue
        d = base / path.lstrip("/")
        if not d.is_dir():  # a cgroup namespace's view: the mount is the process's own cgroup
            d = base
        while True:
            yield version, d
            if d == base:
                break
            d = d.parent


def cgroup_limits(self_cgroup: Path = SELF_CGROUP, root: Path = CGROUP_ROOT) -> List[Limit]:
    """Room under each memory limit set on this process's cgroups (innermost first; unlimited ones left out)."""
    out = []
    for version, d in _cgroup_dirs(self_cgroup, root):
        if version == 2:
            limit, used = _read_int(d / "memory.max"), _read_int(d / "memory.current")
            droppable = _stat(d / "memory.stat", "inactive_file")
        else:
            limit, used = _read_int(d / "memory.limit_in_bytes"), _read_int(d / "memory.usage_in_bytes")
            droppable = _stat(d / "memory.stat", "total_inactive_file")
        if limit is None or used is None or limit >= UNLIMITED:
            continue
        out.append(Limit(f"cgroup v{version} limit {limit >> 20} MiB, less its use:", max(0, limit - used + droppable)))
    return out


class VMStatistics64(ctypes.Structure):
    """struct vm_statistics64 (<mach/vm_statistics.h>)."""

    _fields_ = (
        [(n, ctypes.c_uint32) for n in ("free_count", "active_count", "inactive_count", "wire_count")]
        + [
            (n, ctypes.c_uint64)
            for n in "zero_fill_count reactivations pageins pageouts faults cow_faults lookups hits purges".split()
        ]
        + [(n, ctypes.c_uint32) for n in ("purgeable_count", "speculative_count")]
        + [(n, ctypes.c_uint64) for n in ("decompressions", "compressions", "swapins", "swapouts")]
        + [
            (n, ctypes.c_uint32)
            for n in ("compressor_page_count", "throttled_count", "external_page_count", "internal_page_count")
        ]
        + [("total_uncompressed_pages_in_compressor", ctypes.c_uint64)]
    )


HOST_VM_INFO64 = 4


def reclaimable(stats: VMStatistics64, page_size: int) -> int:
    """Pages macOS hands out without taking them from another process: free, inactive, purgeable, speculative."""
    return (stats.free_count + stats.inactive_count + stats.purgeable_count + stats.speculative_count) * page_size


def macos_limit() -> Optional[Limit]:
    """macOS's reclaimable memory now (host_statistics64), or None."""
    if sys.platform != "darwin":
        return None
    try:
        lib = ctypes.CDLL("/usr/lib/libSystem.B.dylib")
        lib.mach_host_self.restype = ctypes.c_uint32
        stats, count = VMStatistics64(), ctypes.c_uint32(ctypes.sizeof(VMStatistics64) // 4)
        if lib.host_statistics64(lib.mach_host_self(), HOST_VM_INFO64, ctypes.byref(stats), ctypes.byref(count)):
            return None
        page = ctypes.c_size_t()
        lib.host_page_size(lib.mach_host_self(), ctypes.byref(page))
        return Limit("reclaimable (free + inactive + purgeable + speculative)", reclaimable(stats, page.value))
    except (OSError, AttributeError):
        return None


def metal_limit() -> Optional[Limit]:
    """The GPU's recommended working set less what MLX holds, where MLX computes on Metal."""
    import mlx.core as mx

    if not mx.metal.is_available():
        return None
    info = (getattr(mx, "device_info", None) or mx.metal.device_info)()
    most = info.get("max_recommended_working_set_size")
    if not most:
        return None
    return Limit("Metal's recommended working set, less MLX's buffers", max(0, most - mx.get_active_memory()))


def available() -> Available:
    """What every probe of this system says the process can take now (`Available.bytes`: the least)."""
    probes = [meminfo(), *cgroup_limits(), macos_limit(), metal_limit()]
    return Available([p for p in probes if p is not None], ranks_here())
