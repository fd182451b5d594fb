"""The process's own memory, as the operating system counts it: now, at its peak, and the baseline a budget is above.

The budget covers what the runtime allocates above the baseline (the interpreter with mlx and mlx-lm imported and the
model's tokenizer loaded, which every mlx-lm based runtime holds alike); `load` records that baseline and resets the
peak, so `peak_rss() - baseline` is the runtime's own peak.

    Linux   the resident set: /proc/self/status's VmRSS and VmHWM, the peak reset through /proc/self/clear_refs
    macOS   the physical footprint, what macOS counts against a process (Activity Monitor's "Memory", the limits
            that end it): resident and compressed pages, Metal's buffers included. proc_pid_rusage gives it now and
            at its peak since proc_reset_footprint_interval.
    other   getrusage's lifetime peak, and 0 now (`measured()` says so)

MLX's own counters (`mx.get_active_memory`, `mx.get_peak_memory`) count its buffers, on a GPU too: `mlx_bytes()`.
"""

import ctypes
import os
import resource
import sys
from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
RUSAGE_INFO_V4 = 4


class RusageInfoV4(ctypes.Structure):
    """struct rusage_info_v4 (<sys/resource.h>): a UUID, then 35 counters, in this order."""

    _fields_ = [("ri_uuid", ctypes.c_uint8 * 16)] + [
        (name, ctypes.c_uint64)
        for name in (
            "user_time system_time pkg_idle_wkups interrupt_wkups pageins wired_size resident_size phys_footprint "
            "proc_start_abstime proc_exit_abstime child_user_time child_system_time child_pkg_idle_wkups "
            "child_interrupt_wkups child_pageins child_elapsed_abstime diskio_bytesread diskio_byteswritten "
            "cpu_time_qos_default cpu_time_qos_maintenance cpu_time_qos_background cpu_time_qos_utility "
            "cpu_time_qos_legacy cpu_time_qos_user_initiated cpu_time_qos_user_interactive billed_system_time "
            "serviced_system_time logical_writes lifetime_max_phys_footprint instructions cycles billed_energy "
            "serviced_energy interval_max_phys_footprint runnable_time"
        ).split()
    ]


def _libproc():
    """libSystem's proc_pid_rusage and proc_reset_footprint_interval (macOS), or None."""
    if sys.platform != "darwin":
        return None
    try:
        lib = ctypes.CDLL("/usr/lib/libSystem.B.dylib", use_errno=True)
        lib.proc_pid_rusage.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(RusageInfoV4)]
        lib.proc_reset_footprint_interval.argtypes = [ctypes.c_int]
        return lib
    except (OSError, AttributeError):
        return None


_LIBPROC = _libproc()


def _footprint():
    """This process's rusage_info_v4 (macOS), or None."""
    info = RusageInfoV4()
    if _LIBPROC is None or _LIBPROC.proc_pid_rusage(os.getpid(), RUSAGE_INFO_V4, ctypes.byref(info)) != 0:
        return None
    return info


def _status_kib(key: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def measured() -> bool:
    """Whether this system tells the process's memory now (Linux's /proc, macOS's footprint)."""
    return _STATUS.exists() or _footprint() is not None


def rss() -> int:
    """The process's memory now, in bytes (Linux: resident set; macOS: physical footprint; 0 where unknown)."""
    if _STATUS.exists():
        return _status_kib("VmRSS")
    info = _footprint()
    return 0 if info is None else int(info.phys_footprint)


def peak_rss() -> int:
    """The process's peak memory since the last `reset_peak`, in bytes (elsewhere: its lifetime peak)."""
    if _STATUS.exists():
        return _status_kib("VmHWM")
    info = _footprint()
    if info is not None:
        return int(info.interval_max_phys_footprint or info.lifetime_max_phys_footprint)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


def reset_peak() -> bool:
    """Restart the peak from the memory now (Linux: writing 5 to /proc/self/clear_refs; macOS:
    proc_reset_footprint_interval); False if unsupported."""
    if _LIBPROC is not None:
        return _LIBPROC.proc_reset_footprint_interval(os.getpid()) == 0
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def _libc():
    try:
        return ctypes.CDLL("libc.so.6") if sys.platform.startswith("linux") else None
    except OSError:  # not glibc
        return None


_LIBC = _libc()
_MALLOC_TRIM = getattr(_LIBC, "malloc_trim", None)


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MADV_DONTNEED, MADV_HUGEPAGE = 4, 14  # Linux's madvise advice
HUGE_PAGE = 2 << 20


def mmap_large_blocks() -> None:
    """Blocks of 1 MiB and more from mmap, given back to the system when freed. glibc otherwise serves blocks of up
    to 32 MiB from its heaps once one such block was freed, and keeps them: the native kernels' per-call buffers of a
    prompt's chunk (a few MiB a thread) and a server's host KV caches would stay outside the budget."""
    if _LIBC is not None and hasattr(_LIBC, "mallopt"):
        _LIBC.mallopt(M_MMAP_THRESHOLD, 1 << 20)


def huge_pages(buf) -> int:
    """Transparent huge pages for a zero-filled buffer (a unit cache before its reads; Linux): its whole 2 MiB
    pages are marked for them and dropped, so they read as zeros still and the next touch maps one huge page. The
    native kernels stream rows from such memory with far fewer TLB misses. The bytes so marked (0 elsewhere)."""
    if _LIBC is None or not hasattr(_LIBC, "madvise"):
        return 0
    addr = buf.__array_interface__["data"][0]
    start = -(-addr // HUGE_PAGE) * HUGE_PAGE
    n = (addr + buf.nbytes) // HUGE_PAGE * HUGE_PAGE - start
    if n <= 0:
        return 0
    at, size = ctypes.c_void_p(start), ctypes.c_size_t(n)
    if _LIBC.madvise(at, size, MADV_HUGEPAGE) != 0:  # (no THP in this kernel, or disabled)
        return 0
    return n if _LIBC.madvise(at, size, MADV_DONTNEED) == 0 else 0


def give_back() -> None:
    """MLX's cache of freed buffers and the C allocator's free memory back to the system, between a prompt's passes:
    glibc keeps what its arenas freed (a pass's small buffers, some MiB a pass), outside any budget."""
    import mlx.core as mx

    mx.clear_cache()
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def mlx_bytes() -> dict:
    """MLX's own counters: its buffers in use now and at their peak, and its cache of freed buffers."""
    import mlx.core as mx

    return {"active": mx.get_active_memory(), "peak": mx.get_peak_memory(), "cache": mx.get_cache_memory()}


def baseline_command(model_dir) -> list:
    """A child process that only builds the baseline for `model_dir` (mlx, mlx-lm, the model's tokenizer):
    its peak memory is the baseline a hard cap adds to a budget."""
    return [
        sys.executable,
        "-c",
        "import sys, mlx_flash, mlx_lm; from mlx_flash.format.directory import FlashDir; "
        "from mlx_flash.loader import load_tokenizer; load_tokenizer(FlashDir(sys.argv[1])); "
        "from mlx_flash.io.memory import print_own_peak; print_own_peak()",
        str(model_dir),
    ]


def print_own_peak() -> None:
    """Print "VmHWM <kB>", this process's own peak memory, where the system tells it. (A child's wait4 ru_maxrss can
    be its parent's RSS at fork: Linux keeps the larger across exec, so a parent that had just loaded a model
    reports its own size.)"""
    if measured():
        print("VmHWM", peak_rss() // 1024)
