"""The ranks of a pipeline on this machine, each under its own hard memory cap.

    python -m mlx_flash.tools.ranks -n 2 [--limit 1.3GiB] [--drop DIR] -- python -m mlx_flash.generate ...

What `mlx.launch --backend ring -n N -- CMD` does on one machine (the same environment: MLX_RANK and MLX_HOSTFILE
listing a 127.0.0.1 port per rank), with each rank run by tools/cap.py: its own cgroup of --limit, its exit status,
output and peak RSS reported apart. (mlx.launch forwards the ranks' output through threads that poll: on 2 cores
they took a core of their own.)
"""

import argparse
import json
import os
import socket
import sys
import tempfile
import threading
from typing import List, Optional, Sequence

from .cap import CapResult, drop_page_cache, exit_on_sigterm, run_capped


def free_ports(n: int) -> List[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def write_hostfile(n: int) -> str:
    """A ring hostfile (mlx.launch's format) of n ranks on 127.0.0.1; its path."""
    f = tempfile.NamedTemporaryFile("w", prefix="mlx_flash-ranks-", suffix=".json", delete=False)
    with f:
        json.dump([[f"127.0.0.1:{p}"] for p in free_ports(n)], f)
    return f.name


def rank_env(rank: int, hostfile: str, env: Optional[dict] = None) -> dict:
    """The environment mlx.launch gives rank `rank` of the ring backend."""
    return dict(env if env is not None else os.environ, MLX_RANK=str(rank), MLX_HOSTFILE=hostfile)


def run_ranks(
    n: int, cmd: Sequence, limit=None, drop: Sequence = (), timeout: Optional[float] = None, env=None
) -> List[CapResult]:
    """Run `cmd` as ranks 0..n-1 at once, each under a cap of `limit` (None: rusage only); their results. `cmd` and
    `limit` may be lists of one per rank (ranks with budgets of their own)."""
    cmds = list(cmd) if isinstance(cmd[0], (list, tuple)) else [cmd] * n
    limits = list(limit) if isinstance(limit, (list, tuple)) else [limit] * n
    if drop:
        drop_page_cache(drop)
    hostfile = write_hostfile(n)
    results: List[Optional[CapResult]] = [None] * n
    errors = []

    def one(rank):
        try:
            results[rank] = run_capped(cmds[rank], limits[rank], timeout=timeout, env=rank_env(rank, hostfile, env))
        except Exception as e:  # a CapError: reported after the others end
            errors.append(e)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(n)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        os.unlink(hostfile)
    if errors:
        raise errors[0]
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description="Run the ranks of a pipeline on this machine, each under a hard cap.")
    p.add_argument("-n", type=int, required=True, help="Ranks.")
    p.add_argument("--limit", default=None, help="Each rank's hard memory cap (default: none, rusage only).")
    p.add_argument("--drop", nargs="*", default=[], help="Files or directories to evict from the page cache first.")
    p.add_argument("--timeout", type=float, default=None, help="Kill the ranks after this many seconds.")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="The command, after --.")
    args = p.parse_args(argv)
    exit_on_sigterm()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd or args.n < 1:
        print("error: give -n N and a command after --", file=sys.stderr)
        return 2
    results = run_ranks(args.n, cmd, args.limit, args.drop, args.timeout)
    for rank, r in enumerate(results):
        sys.stdout.write(r.stdout)
        sys.stderr.write(r.stderr)
        print(f"rank {rank}: {r.summary()}", file=sys.stderr)
    return max((abs(r.returncode) for r in results), default=0) and 1


if __name__ == "__main__":
    sys.exit(main())
