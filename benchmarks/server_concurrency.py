"""Concurrent chat requests against `python -m mlx_flash.server` under a hard memory cap (continuous batching).

    python benchmarks/server_concurrency.py [--model DIR] [--memory-budget 50% | --cap 2.5GiB] \\
        [--concurrency 1,2,4,8] [--rounds 3] [--prompt-tokens 150] [--max-tokens 128] [--max-context 384] \\
        [--server-args "--max-batch 8"] [--backends auto,mlx] [--peer mlx_lm] [--out JSON] [--plot PNG]
    python benchmarks/server_concurrency.py --from-json JSON [--plot PNG]

The server runs as `python -m mlx_flash.tools.cap --limit CAP --drop DIR --json -- python -m mlx_flash.server
--model DIR --memory-budget B --max-context C --port P --prompt-cache-size 0 [--server-args]`: a memory cgroup
with a hard limit, the model directory dropped from the page cache first. cap = budget + baseline (the peak RSS
of an interpreter with mlx_flash, mlx_lm and the model's tokenizer: peers_systems.measure_baseline); --cap alone
gives budget = cap - baseline. The stored prompt cache is off (--prompt-cache-size 0; --server-args may turn it
on): every request prefills its whole prompt, so no request's time depends on what ran before it. One server per
system and round (the page cache dropped at each start), a warm-up request (--warmup-tokens, not measured) after
/health answers, then every concurrency in an order rotated each round; the systems' order is rotated too.

A run of concurrency N sends N chat requests at once (threads, http.client), each a distinct prompt of about
--prompt-tokens tokens (the chat template included: a WikiText-2 passage from the package's copy, as
benchmarks/prompt_lookup.py picks them, after an instruction to continue it), greedy (temperature 0),
max_tokens --max-tokens, "stream": true with the usage event, "logprobs": true. Per request: time to the first
streamed token (request sent -> first content event), every gap between content events (one token each, except
where the server holds text back: a token that decodes to no text yet, stop-sequence buffering), p50/p95 of
those gaps, generated tokens (the usage event's completion_tokens), the text and, where the stream carries
logprobs with ids, the token ids. Aggregate tokens/s = every request's generated tokens / (last stream finished
- first request sent). Concurrency 1 is always run: it is every prompt of the largest N sent alone, one after
the other (its tokens/s: their tokens / the whole sequence's time; --solo-prompts K: only the first K, for models
whose requests alone take long), and each request of a concurrent run is compared with the same round's solo
response to its prompt: `identical` (token ids where both have them, else the texts), and where they first differ.

Device bytes per generated token: the deltas of the server's GET /metrics ("bytes_read", "generated_tokens"),
sampled before and after each run (and every --metrics-interval s during it, for the largest "batch_size" and
"queue" seen), where it answers 200 with JSON; the server process's /proc/PID/io read_bytes delta over the run
(its own reads, any server) beside it; and cap's device bytes for the server's whole life (load, warm-up and
every run) / the tokens it generated, labelled as such. cap's report (peak RSS, the cgroup's peak, OOM kill)
comes when the server exits: it is stopped with SIGINT (mlx-lm's server loop ends on KeyboardInterrupt).

--peer mlx_lm: stock `python -m mlx_lm.server` on the flash directory's mlx-lm export (mlx_flash.convert.export,
made once where tools/peers_systems.prepare keeps it: <root>/mlx beside a peers <root>/flash, else under
~/.cache/mlx_flash/exports), under the same cap, where the model fits: its export + the baseline within the cap
(and the memory available). It batches concurrent requests itself (decode-concurrency 32).

Medians over --rounds rounds per system and concurrency. The JSON (--out, rewritten after every run) holds every
request; the plot (--plot, default: the JSON's name with .png) shows aggregate tokens/s, time to first token and
p50/p95 inter-token gaps against concurrency, mlx_flash beside mlx_lm where it ran.
"""

import argparse
import hashlib
import http.client
import importlib.util
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import mlx_flash  # noqa: F401  (OpenBLAS before mlx.core)

import numpy as np
from tqdm import tqdm

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
INSTRUCTION = "Continue the following text for several paragraphs, in the same style.\n\n"
MiB = 2**20


# -- prompts ----------------------------------------------------------------------------------------------------
def _passage():
    """benchmarks/prompt_lookup.py's passage(n_words, skip): the skip-th long WikiText-2 test paragraph."""
    spec = importlib.util.spec_from_file_location("_prompt_lookup", HERE / "prompt_lookup.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.passage


def prompt_ids(tokenizer, messages) -> list:
    """The prompt's tokens as mlx-lm's server makes them (chat template, or its plain-text fallback)."""
    if tokenizer.has_chat_template:
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    from mlx_lm.server import convert_chat

    return tokenizer.encode(convert_chat(messages))


def make_prompts(tokenizer, n: int, target: int) -> list:
    """`n` distinct chat prompts of about `target` tokens each: INSTRUCTION + a passage cut to fit."""
    passage = _passage()
    out = []
    for k in range(n):
        ids = tokenizer.encode(passage(n_words=target + 20, skip=k), add_special_tokens=False)
        cut = len(ids)
        for _ in range(6):  # the template's tokens around the text; decode/encode may shift a token or two
            messages = [{"role": "user", "content": INSTRUCTION + tokenizer.decode(ids[:cut]).strip()}]
            have = len(prompt_ids(tokenizer, messages))
            if have == target or (have < target and cut == len(ids)):
                break
            cut = max(1, min(len(ids), cut - (have - target)))
        out.append({"messages": messages, "tokens": have})
    return out


# -- the server under a cap ---------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list:
    kids = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            kids += [int(x) for x in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
        return kids
    except OSError:
        pass
    for d in filter(str.isdigit, os.listdir("/proc")):  # no /proc/PID/task/TID/children: parents from stat
        try:
            if int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(d))
        except (OSError, IndexError, ValueError):
            pass
    return kids


def _get(port: int, path: str, timeout: float = 10):
    """(status, body parsed as JSON or None); (None, None) when nothing answers."""
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        conn.request("GET", path)
        r = conn.getresponse()
        body = r.read()
        conn.close()
    except OSError:
        return None, None
    try:
        return r.status, json.loads(body)
    except ValueError:
        return r.status, None


class CappedServer:
    """A server command under mlx_flash.tools.cap (--json, its report in a file read at the end)."""

    def __init__(self, cmd, cap: int, drop, port: int):
        self.port, self.cmd = port, [str(c) for c in cmd]
        self.report_file = tempfile.TemporaryFile(mode="w+")
        self.err_file = tempfile.TemporaryFile(mode="w+")
        argv = [sys.executable, "-m", "mlx_flash.tools.cap", "--limit", str(cap), "--drop", str(drop), "--json"]
        self.cap = subprocess.Popen([*argv, "--", *self.cmd], stdout=self.report_file, stderr=self.err_file)
        self.pid, self.t0, self.report = None, time.perf_counter(), None

    def alive(self) -> bool:
        return self.cap.poll() is None

    def wait_healthy(self, timeout: float) -> float:
        """Seconds until /health answers 200; RuntimeError if the server exits or `timeout` passes first."""
        while True:
            if not self.alive():
                raise RuntimeError("the server exited before answering /health")
            if self.pid is None:
                kids = _children(self.cap.pid)
                self.pid = kids[0] if kids else None
            if self.pid is not None and _get(self.port, "/health", 5)[0] == 200:
                return time.perf_counter() - self.t0
            if time.perf_counter() - self.t0 > timeout:
                raise RuntimeError(f"the server did not answer /health within {timeout:.0f} s")
            time.sleep(0.5)

    def metrics(self):
        status, body = _get(self.port, "/metrics")
        return body if status == 200 and isinstance(body, dict) else None

    def read_bytes(self):
        try:
            with open(f"/proc/{self.pid}/io") as f:
                return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))
        except (OSError, StopIteration, TypeError):
            return None

    def stop(self, grace: float = 120) -> dict:
        """SIGINT to the server (its loop ends, cap reports), SIGTERM after `grace` s, then cap itself is ended
        (no report). cap's report (its JSON, the server's output cut to its tail)."""
        for sig, wait in ((signal.SIGINT, grace), (signal.SIGTERM, 30)):
            if not self.alive():
                break
            if self.pid is not None:
                try:
                    os.kill(self.pid, sig)
                except ProcessLookupError:
                    pass
            try:
                self.cap.wait(wait)
            except subprocess.TimeoutExpired:
                pass
        if self.alive():
            self.cap.terminate()  # cap kills the server's process group and removes its cgroup
            self.cap.wait(60)
        self.report_file.seek(0)
        self.err_file.seek(0)
        raw, err = self.report_file.read(), self.err_file.read()
        try:
            rep = json.loads(raw)
        except ValueError:
            return {"error": f"no report from cap (exit {self.cap.returncode}): {(raw + err).strip()[-2000:]}"}
        rep.pop("cmd", None)
        rep["stdout"] = rep.get("stdout", "")[-2000:]
        rep["stderr"] = rep.get("stderr", "")[-4000:]
        self.report = rep
        return rep


# -- requests -------------------------------------------------------------------------------------------------
def _pct(xs, q):
    return float(np.percentile(xs, q)) if len(xs) else None


def stream_chat(port, messages, max_tokens, go=None, on_token=None, timeout=3600) -> dict:
    """One streamed chat request; times relative to perf_counter. `go`: an Event to wait for before sending."""
    body = json.dumps(
        {
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "logprobs": True,
        }
    )
    rec = {"error": None, "text": "", "token_ids": None, "content_events": 0}
    times, ids = [], []
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        conn.connect()
        if go is not None:
            go.wait()
        rec["sent"] = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read().decode(errors='replace')[:500]}")
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue  # blank lines and mlx-lm's ": keepalive" comments during the prefill
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(str(event["error"]))
            if event.get("usage"):
                rec["usage"] = event["usage"]
            for choice in event.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    times.append(time.perf_counter())
                    rec["text"] += content
                    if on_token:
                        on_token()
                for lp in ((choice.get("logprobs") or {}).get("content")) or []:
                    ids.append(lp.get("id", lp.get("token")))
                if choice.get("finish_reason"):
                    rec["finish_reason"] = choice["finish_reason"]
        conn.close()
    except Exception as e:  # a failed request is recorded; the run goes on
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["end"] = time.perf_counter()
    rec["content_events"] = len(times)
    rec["token_ids"] = ids or None
    usage = rec.pop("usage", None) or {}
    rec["prompt_tokens"] = usage.get("prompt_tokens")
    rec["generated"] = usage.get("completion_tokens", len(ids) or len(times))
    gaps = [1e3 * (b - a) for a, b in zip(times, times[1:])]
    rec["ttft_s"] = times[0] - rec["sent"] if times and "sent" in rec else None
    rec["gaps_ms"] = [round(g, 2) for g in gaps]
    rec["gap_p50_ms"], rec["gap_p95_ms"] = _pct(gaps, 50), _pct(gaps, 95)
    return rec


class MetricsSampler:
    """GET /metrics every `interval` s during a run: the largest batch_size and queue seen."""

    def __init__(self, server, interval):
        self.server, self.interval, self.stop = server, interval, threading.Event()
        self.max_batch = self.max_queue = None
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self):
        while not self.stop.wait(self.interval):
            m = self.server.metrics()
            if m is None:
                return
            for key, attr in (("batch_size", "max_batch"), ("queue", "max_queue")):
                v = m.get(key)
                v = len(v) if isinstance(v, (list, dict)) else v
                if isinstance(v, (int, float)):
                    setattr(self, attr, max(v, getattr(self, attr) or 0))

    def close(self):
        self.stop.set()
        self.thread.join()


def run_requests(server, prompts, idx, max_tokens, concurrent: bool, interval: float) -> dict:
    """Prompts `idx` at once (concurrent) or one after the other; the run's record."""
    m0, io0 = server.metrics(), server.read_bytes()
    sampler = MetricsSampler(server, interval) if m0 is not None and concurrent else None
    lock = threading.Lock()
    tok_bar = tqdm(total=len(idx) * max_tokens, desc="  tokens", unit="tok", leave=False, position=1)

    def tick():
        with lock:
            tok_bar.update(1)

    t0 = time.perf_counter()
    if concurrent:
        go, results = threading.Event(), [None] * len(idx)

        def one(k, i):
            results[k] = stream_chat(server.port, prompts[i]["messages"], max_tokens, go, tick)

        threads = [threading.Thread(target=one, args=(k, i), daemon=True) for k, i in enumerate(idx)]
        for t in threads:
            t.start()
        time.sleep(0.2)  # every connection open
        go.set()
        for t in threads:
            t.join()
    else:
        results = [stream_chat(server.port, prompts[i]["messages"], max_tokens, None, tick) for i in idx]
    tok_bar.close()
    if sampler:
        sampler.close()
    m1, io1 = server.metrics(), server.read_bytes()
    start = min((r["sent"] for r in results if "sent" in r), default=t0)
    wall = max(r["end"] for r in results) - start
    for i, r in zip(idx, results):
        r["prompt"] = i
        r["sent_s"] = r.pop("sent", start) - start
        r["end_s"] = r.pop("end") - start
    gen = sum(r["generated"] or 0 for r in results)
    gaps = [g for r in results for g in r["gaps_ms"]]
    ttfts = [r["ttft_s"] for r in results if r["ttft_s"] is not None]
    rec = {
        "concurrency": len(idx) if concurrent else 1,
        "requests": results,
        "errors": sum(r["error"] is not None for r in results),
        "generated": gen,
        "wall_s": wall,
        "tok_s": gen / wall if wall > 0 else None,
        "ttft_median_s": statistics.median(ttfts) if ttfts else None,
        "ttft_max_s": max(ttfts) if ttfts else None,
        "gap_p50_ms": _pct(gaps, 50),  # every request's gaps pooled
        "gap_p95_ms": _pct(gaps, 95),
        "proc_read_bytes": io1 - io0 if io0 is not None and io1 is not None else None,
        "metrics": None,
    }
    if m0 is not None and m1 is not None:
        d = {k: m1[k] - m0[k] for k in ("bytes_read", "generated_tokens") if isinstance(m1.get(k), (int, float))}
        d["max_batch_size"] = sampler.max_batch if sampler else None
        d["max_queue"] = sampler.max_queue if sampler else None
        d["after"] = m1
        rec["metrics"] = d
        if d.get("generated_tokens"):
            rec["bytes_per_token"] = d.get("bytes_read", 0) / d["generated_tokens"]
            rec["bytes_per_token_source"] = "/metrics deltas over the run"
    if "bytes_per_token" not in rec and rec["proc_read_bytes"] is not None and gen:
        rec["bytes_per_token"] = rec["proc_read_bytes"] / gen
        rec["bytes_per_token_source"] = "/proc/PID/io read_bytes delta over the run"
    return rec


def compare(rec, solo: dict) -> None:
    """Mark each request `identical` to the solo response to its prompt (token ids where both have them)."""
    for r in rec["requests"]:
        s = solo.get(r["prompt"])
        if s is None or r["error"] or s["error"]:
            r["identical"] = None
            continue
        if r["token_ids"] and s["token_ids"]:
            a, b, r["compared"] = r["token_ids"], s["token_ids"], "token ids"
        else:
            a, b, r["compared"] = r["text"], s["text"], "text"
        r["identical"] = a == b
        if not r["identical"]:
            r["first_difference"] = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def identity(runs, recs, system, bar) -> None:
    """Each concurrent run of a server's round against that round's solo responses; the solo responses against
    the first round's."""
    solo = next((r for r in recs if r["concurrency"] == 1), None)
    if solo is None:
        return
    first = next(r for r in runs if r["system"] == system and r["concurrency"] == 1)
    if first is not solo:
        compare(solo, {q["prompt"]: q for q in first["requests"]})
    for r in recs:
        if r is not solo:
            compare(r, {q["prompt"]: q for q in solo["requests"]})
    bar.write(
        f"{system} round {solo['round'] + 1}: identical to the solo responses: "
        + ", ".join(
            f"N={r['concurrency']} {sum(q.get('identical') is True for q in r['requests'])}/"
            f"{sum(q.get('identical') is not None for q in r['requests'])}"
            for r in sorted(recs, key=lambda r: r["concurrency"])
            if r is not solo or first is not solo
        )
    )


# -- the systems --------------------------------------------------------------------------------------------------
def mlx_export_dir(flash: Path) -> Path:
    """Where the mlx-lm export of `flash` is kept: <root>/mlx beside a peers <root>/flash (tools/peers_systems.prepare
    makes it there), else ~/.cache/mlx_flash/exports/<name>-<hash of its path>/mlx."""
    from mlx_flash.default_model import cache_root

    flash = flash.resolve()
    if flash.name == "flash" and (flash.parent / "flash.conversion").is_file():
        return flash.parent / "mlx"
    return cache_root() / "exports" / f"{flash.name}-{hashlib.sha1(str(flash).encode()).hexdigest()[:8]}" / "mlx"


def dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def prepare_peer(flash: Path, cap: int, baseline: int, model_bytes: int, bar):
    """(mlx-lm export, None) or (None, why it is skipped)."""
    from mlx_flash.budget import fmt_bytes
    from mlx_flash.tools.peers_systems import resident_fits

    if model_bytes + baseline > cap:
        return None, f"the model ({fmt_bytes(model_bytes)}) + baseline ({fmt_bytes(baseline)}) exceed the cap"
    out = mlx_export_dir(flash)
    if not (out / "config.json").is_file():
        from mlx_flash.convert.export import export

        bar.set_postfix_str(f"exporting for mlx-lm into {out}")
        export(flash, out, progress=False)
    size = dir_bytes(out)
    if size + baseline > cap:
        return None, f"the mlx-lm export ({fmt_bytes(size)}) + baseline ({fmt_bytes(baseline)}) exceed the cap"
    if not resident_fits(out, baseline):
        return None, "the mlx-lm export + baseline do not fit in the memory available"
    return out, None


def server_cmd(system, args, model, budget, port, peer_dir):
    if system.startswith("mlx_flash"):  # "mlx_flash" (the default backend) or "mlx_flash --backend B"
        backend = system.split()[2:]
        return [
            sys.executable,
            "-m",
            "mlx_flash.server",
            "--model",
            model,
            "--memory-budget",
            budget,
            "--max-context",
            args.max_context,
            "--port",
            port,
            "--prompt-cache-size",
            0,  # --server-args may override it (the last wins)
            *(["--backend", *backend] if backend else []),
            *shlex.split(args.server_args),
        ]
    return [
        sys.executable,
        "-m",
        "mlx_lm.server",
        "--model",
        peer_dir,
        "--port",
        port,
        "--log-level",
        "WARNING",
        "--prompt-cache-size",
        0,
        *shlex.split(args.peer_args),
    ]


def versions() -> dict:
    import mlx.core as mx
    import mlx_lm

    return {"mlx_flash": mlx_flash.__version__, "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__}


# -- summary, table, plot -----------------------------------------------------------------------------------------
def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(runs) -> dict:
    """{system: {concurrency: medians over rounds}}."""
    out = {}
    for r in runs:
        out.setdefault(r["system"], {}).setdefault(str(r["concurrency"]), []).append(r)
    summary = {}
    for system, by in out.items():
        summary[system] = {}
        for n, rs in sorted(by.items(), key=lambda kv: int(kv[0])):
            reqs = [q for x in rs for q in x["requests"]]
            summary[system][n] = {
                "rounds": len(rs),
                "tok_s": _med([x["tok_s"] for x in rs]),
                "tok_s_all": [x["tok_s"] for x in rs],
                "ttft_median_s": _med([x["ttft_median_s"] for x in rs]),
                "ttft_max_s": _med([x["ttft_max_s"] for x in rs]),
                "gap_p50_ms": _med([x["gap_p50_ms"] for x in rs]),
                "gap_p95_ms": _med([x["gap_p95_ms"] for x in rs]),
                "bytes_per_token": _med([x.get("bytes_per_token") for x in rs]),
                "bytes_per_token_source": next(
                    (x["bytes_per_token_source"] for x in rs if "bytes_per_token" in x), None
                ),
                "max_batch_size": max((x["metrics"] or {}).get("max_batch_size") or 0 for x in rs) or None,
                "generated": _med([x["generated"] for x in rs]),
                "errors": sum(x["errors"] for x in rs),
                "identical": sum(q.get("identical") is True for q in reqs),
                "compared": sum(q.get("identical") is not None for q in reqs),
            }
    return summary


def _f(x, spec="{:.2f}"):
    return "-" if x is None else spec.format(x)


def table(res) -> str:
    rows = [
        "| system | N | tok/s (median) | rounds | TTFT median s | TTFT max s | gap p50 ms | gap p95 ms | "
        "MiB/token | identical to solo | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for system, by in res["summary"].items():
        for n, c in by.items():
            bpt = c["bytes_per_token"]
            rows.append(
                f"| {system} | {n} | {_f(c['tok_s'])} | {', '.join(_f(x) for x in c['tok_s_all'])} | "
                f"{_f(c['ttft_median_s'])} | {_f(c['ttft_max_s'])} | {_f(c['gap_p50_ms'], '{:.1f}')} | "
                f"{_f(c['gap_p95_ms'], '{:.1f}')} | {_f(bpt / MiB if bpt is not None else None, '{:.3f}')} | "
                f"{c['identical']}/{c['compared']} | {c['errors']} |"
            )
    lines = [
        f"model {res['model']}, --memory-budget {res['memory_budget']}, cap {res['cap'] / MiB:.0f} MiB "
        f"(baseline {res['baseline_rss'] / MiB:.0f} MiB), prompts ~{res['prompt_tokens']} tokens, "
        f"max_tokens {res['max_tokens']}, {res['rounds']} round(s)",
        "\n".join(rows),
    ]
    for s in res["servers"]:
        rep = s.get("cap") or {}
        life = s.get("bytes_per_token_server_life")
        lines.append(
            f"{s['system']} round {s['round'] + 1}: "
            + (f"error: {s['error']}; " if s.get("error") else "")
            + (f"up in {s['start_s']:.1f} s; " if s.get("start_s") is not None else "")
            + (
                f"exit {rep.get('returncode')}, OOM {rep.get('oom_killed')}, peak RSS "
                f"{_f((rep.get('max_rss') or 0) / MiB, '{:.0f}')} MiB, cgroup peak "
                f"{_f((rep.get('cgroup_peak') or 0) / MiB, '{:.0f}')} MiB, device "
                f"{_f((rep.get('read_bytes') or 0) / MiB, '{:.1f}')} MiB"
                if rep and "error" not in rep
                else f"cap: {rep.get('error')}"
            )
            + (f"; server life {life / MiB:.3f} MiB/token (load included)" if life else "")
        )
    lines.insert(2, "(identical to solo at N=1: each round's solo responses against round 1's)")
    if res.get("peer_skipped"):
        lines.append(f"mlx_lm skipped: {res['peer_skipped']}")
    return "\n".join(lines)


def _machine_line(res) -> str:
    spec = importlib.util.spec_from_file_location("_plots", HERE / "plots.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.machine_line(res)


def plot(res, path) -> None:
    from mlx_flash.tools.plot import pyplot

    plt = pyplot()
    fig, (ax, tx, gx) = plt.subplots(1, 3, figsize=(14, 4.6))
    colors = {"mlx_flash": "tab:blue", "mlx_flash --backend auto": "tab:blue", "mlx_flash --backend mlx": "tab:orange",
              "mlx_lm": "tab:gray"}  # fmt: skip
    ns = sorted({int(n) for by in res["summary"].values() for n in by})
    for system, by in res["summary"].items():
        xs = [int(n) for n in by]
        cs = list(by.values())
        c = colors.get(system, None)
        ax.plot(xs, [v["tok_s"] for v in cs], "o-", color=c, label=system)
        for x, v in zip(xs, cs):
            ax.plot([x] * len(v["tok_s_all"]), v["tok_s_all"], ".", color="k", ms=3)
        tx.plot(xs, [v["ttft_median_s"] for v in cs], "o-", color=c, label=f"{system}: median")
        tx.plot(xs, [v["ttft_max_s"] for v in cs], "s--", color=c, label=f"{system}: slowest request")
        gx.plot(xs, [v["gap_p50_ms"] for v in cs], "o-", color=c, label=f"{system}: p50")
        gx.plot(xs, [v["gap_p95_ms"] for v in cs], "^--", color=c, label=f"{system}: p95")
    for a, ylabel, title in (
        (ax, "generated tokens/s, all requests (median of rounds; dots: rounds)", "aggregate throughput"),
        (tx, "time to first token, s", "time to first token"),
        (gx, "gap between streamed tokens, ms", "inter-token latency"),
    ):
        a.set_xscale("log", base=2)
        a.set_xticks(ns, [str(n) for n in ns])
        a.set_xlabel("concurrent requests")
        a.set_ylabel(ylabel, fontsize=8)
        a.set_ylim(bottom=0)
        a.set_title(title, fontsize=9)
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    fig.suptitle(
        f"{Path(res['model']).name} through the OpenAI server, hard cap {res['cap'] / MiB:.0f} MiB "
        f"(--memory-budget {res['memory_budget']}); prompts ~{res['prompt_tokens']} tokens, "
        f"{res['max_tokens']} generated, greedy, streamed",
        fontsize=9,
    )
    fig.text(0.01, 0.005, f"{_machine_line(res)}   (benchmarks/server_concurrency.py)", fontsize=6, color="0.4")
    fig.tight_layout(rect=(0, 0.03, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- main -------------------------------------------------------------------------------------------------------
def setup_arg_parser():
    p = argparse.ArgumentParser(
        description="Concurrent streamed chat requests against mlx_flash.server under a hard memory cap."
    )
    p.add_argument("--model", default=None, help="Flash directory (default: SmolLM2-135M-Instruct).")
    p.add_argument("--memory-budget", default=None, help="The server's budget (default: cap - baseline, else 50%%).")
    p.add_argument("--cap", default=None, help="Hard memory cap (default: the budget + the interpreter's baseline).")
    p.add_argument("--max-context", type=int, default=384)
    p.add_argument("--prompt-tokens", type=int, default=150, help="Tokens per prompt, chat template included.")
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens of every request.")
    p.add_argument("--concurrency", default="1,2,4,8", help="Concurrent requests per run (1 is always run).")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--solo-prompts",
        type=int,
        default=None,
        help="N=1 sends only the first K prompts alone (default: every prompt of the largest N); the others are "
        "not compared with a solo response.",
    )
    p.add_argument("--server-args", default="", help='Extra mlx_flash.server flags, e.g. "--max-batch 8".')
    p.add_argument(
        "--backends",
        default="default",
        help="mlx_flash's forward to run, each a system of its own: default (the server's), auto, mlx, native; "
        "e.g. auto,mlx runs the native step and MLX's own ops in the same rounds.",
    )
    p.add_argument("--peer", default=None, choices=["mlx_lm"], help="Also run stock mlx_lm.server where it fits.")
    p.add_argument("--peer-args", default="", help="Extra mlx_lm.server flags.")
    p.add_argument("--warmup-tokens", type=int, default=8, help="A warm-up request after start (0: none).")
    p.add_argument("--metrics-interval", type=float, default=0.5, help="Seconds between /metrics samples in a run.")
    p.add_argument("--start-timeout", type=float, default=1800, help="Seconds for a server to answer /health.")
    p.add_argument("--no-fio", action="store_true", help="Skip fio's reference rate of the disk.")
    p.add_argument("--out", default=None, help="JSON (default: benchmarks/results/server_concurrency_<model>.json).")
    p.add_argument("--plot", default=None, help="PNG (default: the JSON's path with .png; 'none': no plot).")
    p.add_argument("--from-json", default=None, help="Print (and plot) an earlier --out instead of running.")
    return p


def measure(args, bar) -> dict:
    from mlx_flash.budget import fmt_bytes, parse_size
    from mlx_flash.default_model import default_model_dir
    from mlx_flash.format.directory import FlashDir
    from mlx_flash.io.reader import DEFAULT_THREADS
    from mlx_flash.loader import load_tokenizer
    from mlx_flash.peers import fio_reference
    from mlx_flash.tools.bench_io import machine_info
    from mlx_flash.tools.cap import exit_on_sigterm
    from mlx_flash.tools.peers_systems import measure_baseline

    exit_on_sigterm()
    model = Path(args.model or default_model_dir()).expanduser()
    fd = FlashDir(model)
    bar.set_postfix_str("measuring the baseline")
    baseline = measure_baseline(model)
    if args.cap is not None:
        cap = parse_size(args.cap)
        budget = args.memory_budget or str(cap - baseline)
        if cap <= baseline:
            raise SystemExit(f"cap {args.cap} is below the baseline ({fmt_bytes(baseline)})")
    else:
        budget = args.memory_budget or "50%"
        cap = parse_size(budget, fd.model_bytes) + baseline
    ns = sorted({1, *(int(n) for n in args.concurrency.split(","))})
    bar.set_postfix_str("building the prompts")
    tok = load_tokenizer(fd)
    prompts = make_prompts(tok, max(ns) + 1, args.prompt_tokens)  # the last one: the warm-up's
    systems = ["mlx_flash" if b == "default" else f"mlx_flash --backend {b}" for b in args.backends.split(",")]
    peer_dir, skipped = None, None
    if args.peer:
        peer_dir, skipped = prepare_peer(model, cap, baseline, fd.model_bytes, bar)
        if peer_dir is not None:
            systems.append("mlx_lm")
    bar.total = args.rounds * len(systems) * len(ns)
    bar.refresh()
    bar.set_postfix_str("fio")
    fio = None if args.no_fio else fio_reference(fd.ffn_path, DEFAULT_THREADS)
    res = {
        "model": str(model),
        "memory_budget": budget,
        "cap": cap,
        "baseline_rss": baseline,
        "model_bytes": fd.model_bytes,
        "max_context": args.max_context,
        "prompt_tokens": args.prompt_tokens,
        "prompt_tokens_each": [p["tokens"] for p in prompts[:-1]],
        "max_tokens": args.max_tokens,
        "concurrency": ns,
        "rounds": args.rounds,
        "solo_prompts": args.solo_prompts,
        "server_args": args.server_args,
        "peer": args.peer,
        "peer_dir": str(peer_dir) if peer_dir else None,
        "peer_skipped": skipped,
        "prompts": [p["messages"][0]["content"] for p in prompts[:-1]],
        "machine": machine_info(str(model)),
        "versions": versions(),
        "fio": fio,
        "load_average": {"start": [round(x, 1) for x in os.getloadavg()]},
        "timing": "aggregate tok/s = generated tokens / (first request sent -> last stream finished); N=1: every "
        "prompt alone in turn, their tokens / the sequence's time; TTFT = request sent -> first content event",
        "runs": [],
        "servers": [],
    }
    out = Path(args.out)
    for rnd in range(args.rounds):
        k = rnd % len(systems)
        for system in systems[k:] + systems[:k]:
            order = ns[rnd % len(ns) :] + ns[: rnd % len(ns)]
            srv_rec = {"system": system, "round": rnd}
            res["servers"].append(srv_rec)
            port = free_port()
            cmd = server_cmd(system, args, model, budget, port, peer_dir)
            srv_rec["cmd"] = " ".join(map(str, cmd))
            bar.set_postfix_str(f"{system} round {rnd + 1}: starting the server")
            server = CappedServer(cmd, cap, peer_dir if system == "mlx_lm" else model, port)
            generated = 0
            try:
                srv_rec["start_s"] = server.wait_healthy(args.start_timeout)
                if args.warmup_tokens:
                    bar.set_postfix_str(f"{system} round {rnd + 1}: warm-up")
                    w = stream_chat(port, prompts[-1]["messages"], args.warmup_tokens)
                    srv_rec["warmup"] = {k: w[k] for k in ("error", "generated", "ttft_s")}
                    generated += w["generated"] or 0
                recs = []
                for n in order:
                    if not server.alive():
                        raise RuntimeError("the server exited")
                    bar.set_postfix_str(f"{system} round {rnd + 1}: N={n}")
                    idx = list(range(args.solo_prompts or max(ns))) if n == 1 else list(range(n))
                    rec = run_requests(server, prompts, idx, args.max_tokens, n > 1, args.metrics_interval)
                    rec.update(system=system, round=rnd)
                    generated += rec["generated"]
                    res["runs"].append(rec)
                    recs.append(rec)
                    bar.update(1)
                    bar.write(
                        f"{system} r{rnd + 1} N={n}: {_f(rec['tok_s'])} tok/s, TTFT median "
                        f"{_f(rec['ttft_median_s'])} s, gaps p50/p95 {_f(rec['gap_p50_ms'], '{:.1f}')}/"
                        f"{_f(rec['gap_p95_ms'], '{:.1f}')} ms, {rec['generated']} tokens"
                        + (f", {rec['errors']} errors" if rec["errors"] else "")
                    )
                    out.write_text(json.dumps(dict(res, summary=summarize(res["runs"])), indent=1))
                identity(res["runs"], recs, system, bar)
            except RuntimeError as e:
                srv_rec["error"] = str(e)
                bar.write(f"{system} round {rnd + 1}: {e}")
            finally:
                bar.set_postfix_str(f"{system} round {rnd + 1}: stopping the server")
                rep = server.stop()
                srv_rec["cap"] = rep
                srv_rec["generated"] = generated
                if generated and rep.get("read_bytes") is not None:
                    srv_rec["bytes_per_token_server_life"] = rep["read_bytes"] / generated
                    srv_rec["bytes_per_token_server_life_note"] = (
                        "cap's device bytes for the server's whole life (load, warm-up, every run) / the tokens it "
                        "generated"
                    )
            out.write_text(json.dumps(dict(res, summary=summarize(res["runs"])), indent=1))
    if fio:
        bar.set_postfix_str("fio")
        res["fio_end"] = fio_reference(fd.ffn_path, DEFAULT_THREADS)
    res["load_average"]["end"] = [round(x, 1) for x in os.getloadavg()]
    res["summary"] = summarize(res["runs"])
    out.write_text(json.dumps(res, indent=1))
    return res


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    if args.from_json:
        res = json.loads(Path(args.from_json).read_text())
        out = Path(args.from_json)
    else:
        bar = tqdm(total=None, desc="server_concurrency", unit="run", position=0)
        bar.set_postfix_str("starting")
        if args.out is None:
            path = Path(args.model).expanduser() if args.model else None
            name = "smollm2" if path is None else path.parent.name if path.name == "flash" else path.name
            args.out = str(RESULTS / f"server_concurrency_{name}.json")
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            res = measure(args, bar)
        finally:
            bar.close()
    print(table(res))
    plot_path = args.plot or str(out.with_suffix(".png"))
    if plot_path != "none" and res.get("summary"):
        plot(res, plot_path)
        print(plot_path)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
