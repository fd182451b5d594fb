"""Run a command under a hard memory cap, the way a user with that much RAM would run it.

    python -m mlx_flash.tools.cap --limit 2.5GiB [--drop FILE_OR_DIR ...] [--json] -- CMD ...

The command runs in a new memory cgroup (below this process's own one) whose limit is the cap:
cgroup v1 (memory.limit_in_bytes, and memory.memsw.limit_in_bytes where present), cgroup v2
(memory.max, memory.swap.max = 0), or `systemd-run --scope -p MemoryMax=` where neither is
writable; CapError when none works. The cgroup is removed afterwards.

In cgroup v1 and v2 the page cache a command fills is charged to its cgroup: a program that
mmaps its weights pays for the cached pages, as it would on a machine with that much memory.
Pages cached before the run are not charged, so --drop evicts the given files from the page
cache first (fsync, then POSIX_FADV_DONTNEED).

Reported: exit code, whether the OOM killer fired, the cgroup's peak usage (page cache
included), and the child's rusage from wait4: peak RSS (never below the launching process's own: Linux's exec
keeps the larger of the two, so a large launcher runs this as its own small process), major faults, bytes read
from the device (ru_inblock x 512: O_DIRECT reads, page-cache misses and mmap faults alike), wall time.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import List, Optional, Sequence

from ..budget import fmt_bytes, parse_size
from ..errors import CapError

V1_ROOT = Path("/sys/fs/cgroup/memory")
V2_ROOT = Path("/sys/fs/cgroup")


@dataclass
class CapResult:
    cmd: List[str]
    limit: Optional[int]  # bytes; None: run without a cap (rusage only)
    backend: str  # "cgroup1", "cgroup2", "systemd-run" or "none"
    returncode: int  # negative: killed by that signal
    oom_killed: bool
    cgroup_peak: Optional[int]  # bytes charged to the cgroup at most (page cache included)
    max_rss: int  # bytes, the child's peak resident set
    major_faults: int
    read_bytes: int  # read at the device: ru_inblock * 512
    wall_s: float
    timed_out: bool
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.oom_killed and not self.timed_out

    def summary(self) -> str:
        status = "OOM-killed" if self.oom_killed else "timed out" if self.timed_out else f"exit {self.returncode}"
        return (
            f"{status} under {fmt_bytes(self.limit) if self.limit else 'no cap'} ({self.backend}): "
            f"wall {self.wall_s:.1f} s, peak RSS {fmt_bytes(self.max_rss)}, "
            + (f"cgroup peak {fmt_bytes(self.cgroup_peak)}, " if self.cgroup_peak is not None else "")
            + f"read {fmt_bytes(self.read_bytes)} from the device, {self.major_faults} major faults"
        )


def drop_page_cache(paths: Sequence) -> None:
    """Evict files (directories: every file below them) from the page cache. Where the system has no
    posix_fadvise (macOS) nothing is evicted: the runtime's own reads bypass the cache there (F_NOCACHE)."""
    if not hasattr(os, "posix_fadvise"):
        return
    for p in map(Path, paths):
        files = [f for f in p.rglob("*") if f.is_file()] if p.is_dir() else [p]
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)  # dirty pages cannot be dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _own_cgroup(controller: str) -> str:
    """This process's cgroup path in the v1 `controller` hierarchy ("" for v2's unified one)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers.split(",") == [controller] or (controller == "" and controllers == ""):
            return path.lstrip("/")
    return ""


def _write(path: Path, value) -> None:
    path.write_text(str(value))


class _Cgroup:
    """A memory cgroup with a hard limit (v1 or v2), created below this process's own one."""

    def __init__(self, limit: int):
        name = f"mlx_flash_cap_{os.getpid()}_{time.monotonic_ns()}"
        if (V1_ROOT / "memory.limit_in_bytes").exists():
            self.backend, parent = "cgroup1", V1_ROOT / _own_cgroup("memory")
        elif (V2_ROOT / "cgroup.controllers").exists():
            self.backend, parent = "cgroup2", V2_ROOT / _own_cgroup("")
        else:
            raise CapError("no cgroup memory controller mounted at /sys/fs/cgroup")
        self.path = parent / name
        try:
            self.path.mkdir()
        except OSError as e:
            raise CapError(f"cannot create the memory cgroup {self.path}: {e}") from e
        try:
            if self.backend == "cgroup1":
                _write(self.path / "memory.limit_in_bytes", limit)
                if (self.path / "memory.memsw.limit_in_bytes").exists():  # no swapping around the cap
                    _write(self.path / "memory.memsw.limit_in_bytes", limit)
            else:
                if not (self.path / "memory.max").exists():
                    raise CapError(
                        f"{parent}: the memory controller is not enabled for child cgroups (cgroup.subtree_control)"
                    )
                _write(self.path / "memory.max", limit)
                if (self.path / "memory.swap.max").exists():
                    _write(self.path / "memory.swap.max", 0)
        except OSError as e:
            self.remove()
            raise CapError(f"cannot set the memory limit of {self.path}: {e}") from e

    def enter(self) -> None:
        """In the child between fork and exec: move it into the cgroup before it allocates anything."""
        _write(self.path / "cgroup.procs", os.getpid())

    def _read(self, name: str) -> Optional[str]:
        try:
            return (self.path / name).read_text()
        except OSError:
            return None

    def _counter(self, name: str, key: str) -> int:
        for line in (self._read(name) or "").splitlines():
            k, _, v = line.partition(" ")
            if k == key:
                return int(v)
        return 0

    def peak(self) -> Optional[int]:
        v = self._read("memory.max_usage_in_bytes" if self.backend == "cgroup1" else "memory.peak")
        return int(v) if v else None

    def oom_kills(self) -> int:
        if self.backend == "cgroup1":
            return self._counter("memory.oom_control", "oom_kill")
        return self._counter("memory.events", "oom_kill")

    def hit_limit(self) -> bool:
        if self.backend == "cgroup1":
            return int(self._read("memory.failcnt") or 0) > 0
        return self._counter("memory.events", "max") > 0

    def remove(self) -> None:
        for _ in range(50):  # the killed child's exit can lag behind wait4 by a moment
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)


def _systemd_run_works() -> bool:
    try:
        r = subprocess.run(
            ["systemd-run", "--scope", "--quiet", "-p", "MemoryMax=1G", "true"], capture_output=True, timeout=30
        )
        return r.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def run_capped(
    cmd: Sequence[str], limit=None, drop: Sequence = (), timeout: Optional[float] = None, env=None, cwd=None, stdin=None
) -> CapResult:
    """Run `cmd` under a hard memory cap of `limit` (bytes or "2.5GiB"; None: no cap, rusage only).

    `drop`: files or directories evicted from the page cache first. Output is captured.
    Raises CapError when no cgroup can be made (and systemd-run does not work either)."""
    cmd = [str(c) for c in cmd]
    limit = parse_size(limit) if limit is not None else None
    if drop:
        drop_page_cache(drop)
    # SIGTERM waits until the child is known, so that its handler (exit_on_sigterm) takes the child and the cgroup
    # down with it, never one made and not yet held
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        return _run(cmd, limit, cwd, env, timeout, stdin, mask)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _run(cmd, limit, cwd, env, timeout, stdin, mask) -> CapResult:
    cgroup, backend, argv = None, "none", cmd
    if limit is not None:
        try:
            cgroup = _Cgroup(limit)
            backend = cgroup.backend
        except CapError as first:
            if not _systemd_run_works():
                raise CapError(f"{first}; systemd-run --scope does not work here either") from first
            backend = "systemd-run"
            argv = [
                "systemd-run",
                "--scope",
                "--quiet",
                "-p",
                f"MemoryMax={limit}",
                "-p",
                "MemorySwapMax=0",
                "--",
                *cmd,
            ]
    try:
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            t0 = time.perf_counter()
            p = subprocess.Popen(
                argv,
                stdout=out,
                stderr=err,
                stdin=stdin or subprocess.DEVNULL,
                env=env,
                cwd=cwd,
                preexec_fn=lambda: _child(cgroup, mask),
                start_new_session=True,
            )
            timed_out = False
            deadline = None if timeout is None else t0 + timeout
            try:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
                while True:  # wait4 (not Popen.wait): it returns the child's rusage
                    pid, status, ru = os.wait4(p.pid, os.WNOHANG if deadline else 0)
                    if pid:
                        break
                    if time.perf_counter() > deadline:
                        timed_out = True
                        os.killpg(p.pid, signal.SIGKILL)
                        deadline = None
                    else:
                        time.sleep(0.05)
            except BaseException:  # interrupted: take the child down too, so its cgroup can go
                os.killpg(p.pid, signal.SIGKILL)
                os.waitpid(p.pid, 0)
                p.returncode = -signal.SIGKILL
                raise
            wall = time.perf_counter() - t0
            p.returncode = os.waitstatus_to_exitcode(status)
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
        oom = False
        peak = None
        if cgroup is not None:
            peak = cgroup.peak()
            # the OOM killer's own count; older kernels lack it: a SIGKILL after hitting the limit
            oom = cgroup.oom_kills() > 0 or (p.returncode == -signal.SIGKILL and cgroup.hit_limit() and not timed_out)
        elif backend == "systemd-run":
            oom = p.returncode == -signal.SIGKILL or "oom" in stderr.lower()
        return CapResult(
            cmd,
            limit,
            backend,
            p.returncode,
            oom,
            peak,
            ru.ru_maxrss * (1 if sys.platform == "darwin" else 1024),  # macOS reports bytes, Linux KiB
            ru.ru_majflt,
            ru.ru_inblock * 512,
            wall,
            timed_out,
            stdout,
            stderr,
        )
    finally:
        if cgroup is not None:
            cgroup.remove()


def _child(cgroup: Optional[_Cgroup], mask) -> None:
    """In the child between fork and exec: the parent's signal mask, and into the cgroup before it allocates."""
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    if cgroup is not None:
        cgroup.enter()


def setup_arg_parser():
    p = argparse.ArgumentParser(
        description="Run a command under a hard memory cap (a memory cgroup) and report "
        "exit, OOM kill, peak memory and bytes read.",
        usage="python -m mlx_flash.tools.cap --limit 2.5GiB [--drop FILE ...] -- CMD ...",
    )
    p.add_argument("--limit", required=True, help="Hard memory cap: bytes, 2.5GiB, 512MB ('none': no cap).")
    p.add_argument("--drop", nargs="*", default=[], help="Files or directories to evict from the page cache first.")
    p.add_argument("--timeout", type=float, default=None, help="Kill the command after this many seconds.")
    p.add_argument("--json", action="store_true", help="Print the report as JSON (with the output) on stdout.")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="The command, after --.")
    return p


def exit_on_sigterm() -> None:
    """SIGTERM raises SystemExit, so a running child is killed and its cgroup removed on the way out."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    exit_on_sigterm()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        print("error: no command given (put it after --)", file=sys.stderr)
        return 2
    try:
        r = run_capped(cmd, None if args.limit.lower() == "none" else args.limit, args.drop, args.timeout)
    except (CapError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(asdict(r), indent=2))
    else:
        sys.stdout.write(r.stdout)
        sys.stderr.write(r.stderr)
        print(f"[cap] {r.summary()}", file=sys.stderr)
    return 0 if r.ok else (r.returncode or 1)


if __name__ == "__main__":
    sys.exit(main())
