"""The process's own memory, as a user's machine sees it: resident set size now and at its peak.

The budget covers what the runtime allocates above the baseline (the interpreter with mlx and mlx-lm
imported and the model's tokenizer loaded, which every mlx-lm based runtime holds alike); `load`
records that baseline and resets the peak, so `peak_above_baseline()` is the runtime's own peak.
Linux reads /proc/self/status; elsewhere the peak comes from getrusage (not resettable) and RSS is 0.
"""

import resource
import sys
from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(key: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def rss() -> int:
    """Resident set size now, in bytes (0 where /proc is missing)."""
    return _status_kib("VmRSS") if _STATUS.exists() else 0


def peak_rss() -> int:
    """Peak resident set size (VmHWM; since the last `reset_peak`), in bytes."""
    if _STATUS.exists():
        return _status_kib("VmHWM")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


def baseline_command(model_dir) -> list:
    """A child process that only builds the baseline for `model_dir` (mlx, mlx-lm, the model's tokenizer):
    its peak RSS is the baseline a hard cap adds to a budget."""
    return [
        sys.executable,
        "-c",
        "import sys, mlx_flash, mlx_lm; from mlx_flash.format.directory import FlashDir; "
        "from mlx_flash.loader import load_tokenizer; load_tokenizer(FlashDir(sys.argv[1])); "
        "from mlx_flash.io.memory import print_own_peak; print_own_peak()",
        str(model_dir),
    ]


def print_own_peak() -> None:
    """Print "VmHWM <kB>", this process's own peak RSS, where /proc has it. (A child's wait4 ru_maxrss can be
    its parent's RSS at fork: Linux keeps the larger across exec, so a parent that had just loaded a model
    reports its own size.)"""
    try:
        line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmHWM"))
        print("VmHWM", line.split()[1])
    except (OSError, StopIteration):
        pass


def reset_peak() -> bool:
    """Restart the peak from the current RSS (Linux: writing 5 to /proc/self/clear_refs); False if unsupported."""
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False
