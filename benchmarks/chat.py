"""A five-turn chat through `python -m mlx_flash.server`, with the prompt cache on and off, under a
memory budget and with everything resident.

    python benchmarks/chat.py --memory-budget 50% --max-context 768 --out benchmarks/results/chat_smollm2.json \\
        --plot benchmarks/results/chat_smollm2.png
    python benchmarks/chat.py --from-json benchmarks/results/chat_smollm2.json [--plot OUT.png]

The first user message is ~350 tokens (--first-tokens) of WikiText-2 (mlx_flash.texts.read_text()), then four short
questions on the growing history (the model's own replies included). Each configuration starts
its own server process (the budgeted ones with --memory-budget, the "everything resident" ones
with none, the server's default); per turn the client (http.client, streaming) measures the time
to the first token, decode tokens/s and the bytes the server process read at the device
(/proc/PID/io read_bytes), split at the first streamed token into prefill (request sent -> first
token) and decode (first token -> end). A prompt-cache configuration's turns are compared with
its cold counterpart (the same server flags without the prompt cache) on the same turn: its
prefill bytes and time to first token over theirs. Under a budget the stored prompt cache takes
room the plan would otherwise give to resident weights and unit caches, so the cold counterpart
runs another plan; "evicted each turn" is the prompt-cache server itself with its stored cache
evicted before every turn (by an unrelated one-token completion; LRU of one), a cold prefill on
the same plan.

The server runs at --log-level INFO, so each turn also has the server's own bytes per forward pass
(`mlx_flash.server.read_summary`): the prompt's prefill passes (the last one gives the first
token), then the single-token passes. The first streamed token arrives after the prefill passes
only (`mlx_flash.generate.generate_step`; mlx-lm's loop would add a pass on the prompt's last
token and one on the next token before it). Greedy decoding, so every configuration sees the
same history as long as their tokens agree.
"""

import argparse
import http.client
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from importlib.metadata import version
from pathlib import Path

import mlx_flash  # noqa: F401  (OpenBLAS before mlx.core)

QUESTIONS = [
    "Who is the text about?",
    "What was his first role?",
    "Which theatre is named in the text?",
    "Summarise the text in one sentence.",
]
# name -> server flags (budget: with --memory-budget) and, for a prompt-cache run, its cold counterpart
CONFIGS = {
    "float KV, no prompt cache": {"budget": True, "flags": ["--prompt-cache-size", "0"]},
    "8-bit KV, no prompt cache": {"budget": True, "flags": ["--kv-bits", "8", "--prompt-cache-size", "0"]},
    "8-bit KV, prompt cache": {
        "budget": True,
        "flags": ["--kv-bits", "8", "--prompt-cache-size", "1"],
        "cold": "8-bit KV, no prompt cache",
        "same_plan": "8-bit KV, prompt cache evicted each turn",
    },
    "8-bit KV, prompt cache evicted each turn": {
        "budget": True,
        "flags": ["--kv-bits", "8", "--prompt-cache-size", "1"],
        "evict": True,
    },
    "resident, no prompt cache": {"budget": False, "flags": ["--prompt-cache-size", "0"]},
    "resident, prompt cache": {
        "budget": False,
        "flags": ["--prompt-cache-size", "1"],
        "cold": "resident, no prompt cache",
    },
}
READS = "flash reads: "  # mlx_flash.server's per-request log line
MiB = 2**20


def first_message(tokenizer, n_tokens: int = 350) -> str:
    from mlx_flash.texts import read_text

    ids = tokenizer.encode(read_text().strip())[:n_tokens]
    return "Read this text:\n\n" + tokenizer.decode(ids)


def read_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


class Server:
    """A server process; its stderr is drained in a thread (the log lines of every request)."""

    def __init__(self, model, budget, max_context, flags):
        cmd = [
            sys.executable,
            "-m",
            "mlx_flash.server",
            "--model",
            str(model),
            "--port",
            "0",
            "--max-context",
            str(max_context),
            "--log-level",
            "INFO",
            "--max-batch",
            "1",  # one request at a time: its reads logged pass by pass
            *flags,
        ]
        if budget is not None:
            cmd += ["--memory-budget", budget]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        self.pid, self.lines, self.reads = self.proc.pid, [], queue.Queue()
        started = queue.Queue()
        threading.Thread(target=self._drain, args=(started,), daemon=True).start()
        self.port = started.get()
        if self.port is None:
            raise RuntimeError("the server did not start:\n" + "".join(self.lines))

    def _drain(self, started):
        port = None
        for line in self.proc.stderr:
            if port is None:
                self.lines.append(line)
                m = re.search(r"serving .* on http://[\d.]+:(\d+)/v1", line)
                if m:
                    port = int(m.group(1))
                    started.put(port)
            elif READS in line:
                self.reads.put(json.loads(line.split(READS, 1)[1]))
            elif " - INFO - " not in line:
                self.lines.append(line)  # warnings, errors
        if port is None:
            started.put(None)

    @property
    def log(self) -> str:
        return "".join(line for line in self.lines if " - INFO - " not in line).strip()

    def close(self):
        self.proc.terminate()
        self.proc.wait(timeout=60)


def turn(server, messages, max_tokens):
    """One streamed chat request: (reply, stats)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=3600)
    body = {
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0.0,
        "stream_options": {"include_usage": True},
    }
    read0, t0 = read_bytes(server.pid), time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"{r.status}: {r.read().decode()}")
    text, first, read1, usage = "", None, None, None
    for line in r:
        line = line.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue  # blank lines and mlx-lm's ": keepalive" comments during the prefill
        event = json.loads(line[6:])
        if "error" in event:
            raise RuntimeError(event["error"])
        usage = event.get("usage") or usage
        for choice in event["choices"]:
            content = choice.get("delta", {}).get("content")
            if content:
                if first is None:
                    first, read1 = time.perf_counter(), read_bytes(server.pid)
                text += content
    end, read2 = time.perf_counter(), read_bytes(server.pid)
    conn.close()
    passes = server.reads.get(timeout=600)  # logged once the request is done
    n = usage["completion_tokens"]
    return text, {
        "prompt_tokens": usage["prompt_tokens"],
        "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
        "completion_tokens": n,
        "ttft_s": round(first - t0, 3),
        "decode_tok_s": round((n - 1) / (end - first), 3) if n > 1 and end > first else None,
        "device_bytes_read": read2 - read0,
        "prefill_bytes": read1 - read0,  # request sent -> first streamed token
        "decode_bytes": read2 - read1,  # first token -> end of the stream
        "server_passes": passes,  # the server's bytes per forward pass (mlx_flash.server.read_summary)
    }


def evict(server):
    """An unrelated one-token completion (no chat template: no common prefix), whose stored cache
    replaces the conversation's in an LRU of one."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=3600)
    conn.request(
        "POST",
        "/v1/completions",
        json.dumps({"prompt": "Hello", "max_tokens": 1}),
        {"Content-Type": "application/json"},
    )
    r = conn.getresponse()
    r.read()
    conn.close()
    if r.status != 200:
        raise RuntimeError(f"evicting: {r.status}")
    server.reads.get(timeout=600)


def run_config(model, args, name, first):
    from tqdm import tqdm

    cfg = CONFIGS[name]
    server = Server(model, args.memory_budget if cfg["budget"] else None, args.max_context, cfg["flags"])
    try:
        messages, turns = [], []
        for q in tqdm([first] + QUESTIONS, desc=name, leave=False):
            if cfg.get("evict") and messages:
                evict(server)
            messages.append({"role": "user", "content": q})
            reply, stats = turn(server, messages, args.max_tokens)
            messages.append({"role": "assistant", "content": reply})
            turns.append(dict(stats, reply=reply))
        return {
            "flags": cfg["flags"],
            "memory_budget": args.memory_budget if cfg["budget"] else None,
            "cold": cfg.get("cold"),
            "same_plan": cfg.get("same_plan"),
            "server_log": server.log,
            "turns": turns,
        }
    finally:
        server.close()


def _over(x, cold):
    return x / cold if cold >= MiB else None  # a cold turn that read (next to) nothing: no ratio


def _vs(t, c) -> dict:
    return {
        "prefill_bytes": _over(t["prefill_bytes"], c["prefill_bytes"]),
        "prefill_pass_bytes": _over(
            sum(t["server_passes"]["prefill_passes"]), sum(c["server_passes"]["prefill_passes"])
        ),
        "ttft_s": t["ttft_s"] / c["ttft_s"],
    }


def compare(results) -> dict:
    """Per prompt-cache configuration and turn, over its cold counterpart's on the same turn (and
    "same_plan": over the evicted run's): the prefill bytes (request -> first token), the bytes of
    the prefill passes alone (the server's count) and the time to the first token."""
    out = {}
    for name, res in results.items():
        cold = results.get(res.get("cold") or "")
        if cold is None:
            continue
        same = results.get(res.get("same_plan") or "")
        out[name] = [
            dict(_vs(t, c), same_plan=_vs(t, s) if same else None)
            for t, c, s in zip(res["turns"], cold["turns"], (same or cold)["turns"])
        ]
    return out


def _mib(b) -> str:
    return f"{b / MiB:.1f}"


def _ratio(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def table(results) -> str:
    vs = compare(results)
    rows = [
        (
            "| configuration | budget | turn | prompt tokens | cached | TTFT s | decode tok/s | prefill MiB | "
            "decode MiB | prefill / cold | TTFT / cold | prefill / cold, same plan | TTFT / cold, same plan |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, res in results.items():
        for i, t in enumerate(res["turns"]):
            r = vs[name][i] if name in vs else {}
            same = r.get("same_plan") or {}
            rows.append(
                f"| {name} | {res.get('memory_budget') or 'none'} | {i + 1} | {t['prompt_tokens']} | "
                f"{t['cached_tokens']} | {t['ttft_s']:.1f} | {t['decode_tok_s'] or 0:.2f} | "
                f"{_mib(t['prefill_bytes'])} | {_mib(t['decode_bytes'])} | "
                f"{_ratio(r.get('prefill_bytes'))} | {_ratio(r.get('ttft_s'))} | "
                f"{_ratio(same.get('prefill_bytes'))} | {_ratio(same.get('ttft_s'))} |"
            )
    return "\n".join(rows)


def passes_table(results) -> str:
    """The server's own split of a turn's bytes: the prompt's passes (before the first streamed token),
    then the single-token passes (one per later token, and one feeding the last into the prompt cache)."""
    vs = compare(results)
    rows = [
        "| configuration | turn | prompt passes | their MiB | / cold | single-token passes | MiB each (mean) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, res in results.items():
        for i, t in enumerate(res["turns"]):
            p = t["server_passes"]
            pre, dec = p["prefill_passes"], p["decode_passes"]
            r = vs[name][i] if name in vs else {}
            rows.append(
                f"| {name} | {i + 1} | {len(pre)} | {_mib(sum(pre))} | {_ratio(r.get('prefill_pass_bytes'))} | "
                f"{len(dec)} | {_mib(sum(dec) / len(dec)) if dec else '-'} |"
            )
    return "\n".join(rows)


def verdict(results) -> str:
    """Turns 2-5 of each prompt-cache run against the targets: < 1/10 of a cold prefill's bytes,
    at most half of a cold request's time to the first token."""
    lines = []
    for name, rows in compare(results).items():
        refs = [("cold: " + results[name]["cold"], rows[1:])]
        if rows[0]["same_plan"] is not None:
            refs.append(("cold, same plan: " + results[name]["same_plan"], [r["same_plan"] for r in rows[1:]]))
        for ref, later in refs:
            b = [r["prefill_bytes"] for r in later]
            t = [r["ttft_s"] for r in later]
            if any(x is None for x in b):
                bytes_part = "prefill bytes: the cold run read < 1 MiB on some of these turns (no ratio)"
            else:
                bytes_part = (
                    f"prefill bytes {min(b):.3f}-{max(b):.3f} of a cold prefill's "
                    f"({'meets' if max(b) < 0.1 else 'misses'} < 0.1)"
                )
            lines.append(
                f"{name}, turns 2-5 ({ref}): {bytes_part}; time to first token {min(t):.3f}-{max(t):.3f} "
                f"of a cold request's ({'meets' if max(t) <= 0.5 else 'misses'} <= 0.5)"
            )
    return "\n".join(lines)


def plot(out, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    results = out["results"]
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(10, 5.2))
    for name, res in results.items():
        turns = range(1, len(res["turns"]) + 1)
        style = {"marker": "o", "ls": "-" if res.get("cold") else "--"}  # solid: the prompt cache reused
        label = f"{name} ({'budget ' + res['memory_budget'] if res.get('memory_budget') else 'no budget'})"
        ax_t.plot(turns, [t["ttft_s"] for t in res["turns"]], label=label, **style)
        ax_b.plot(turns, [t["prefill_bytes"] / MiB for t in res["turns"]], label=label, **style)
    for res in results.values():  # the target: a tenth of a cold prefill's bytes on the same plan
        cold = results.get(res.get("same_plan") or res.get("cold") or "")
        if cold is not None and all(t["prefill_bytes"] >= MiB for t in cold["turns"]):
            ax_b.plot(
                range(1, len(cold["turns"]) + 1),
                [t["prefill_bytes"] / 10 / MiB for t in cold["turns"]],
                ls=":",
                color="gray",
                label=f"a tenth of {res['same_plan'] or res['cold']}",
            )
    ax_t.set_yscale("log")
    ax_t.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax_t.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax_t.set_yticks([1, 2, 5, 10, 20, 50])
    ax_t.set_ylabel("time to first token, s (log)")
    ax_b.set_ylabel("device MiB read, request -> first token")
    ax_b.set_ylim(bottom=0)
    for ax in (ax_t, ax_b):
        ax.set_xlabel("turn")
        ax.set_xticks(range(1, 6))
        ax.grid(alpha=0.3)
    fig.legend(*ax_b.get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=7)
    fig.suptitle(
        f"{Path(out['model']).name}: a five-turn chat through mlx_flash.server, prompt cache reused (solid) "
        f"or not (dashed)",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0.13, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def header(out) -> str:
    m, v = out["machine"], out.get("versions", {})
    return (
        f"model {out['model']}, --memory-budget {out['memory_budget']} (and none), --max-context "
        f"{out['max_context']}, {out['max_tokens']} tokens per reply\n"
        f"machine: {m.get('cpu', '?')}, {m.get('cores')} cores, {m.get('ram_gib')} GiB, "
        f"{m.get('filesystem', '?')}; python {m['python']}, mlx {m['mlx']}"
        + "".join(f", {k} {val}" for k, val in v.items())
        + (f"; load average {out['load_average']}" if "load_average" in out else "")
    )


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="Flash directory (default: SmolLM2-135M-Instruct).")
    p.add_argument("--memory-budget", default="50%", help="The budget of the budgeted configurations.")
    p.add_argument("--max-context", type=int, default=768)
    p.add_argument("--max-tokens", type=int, default=32, help="Tokens per reply.")
    p.add_argument("--first-tokens", type=int, default=350, help="Tokens of WikiText-2 in the first message.")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--out", default=None, help="Write the results as JSON here.")
    p.add_argument("--plot", default=None, help="Plot time to first token and prefill bytes per turn here (png).")
    p.add_argument("--from-json", default=None, help="Print (and --plot) an earlier --out instead of running.")
    args = p.parse_args()

    if args.from_json:
        out = json.loads(Path(args.from_json).read_text())
    else:
        from mlx_flash.default_model import default_model_dir
        from mlx_flash.format.directory import FlashDir
        from mlx_flash.loader import load_tokenizer
        from mlx_flash.tools.bench_io import machine_info

        model = args.model or default_model_dir()
        first = first_message(load_tokenizer(FlashDir(model)), args.first_tokens)
        load0 = os.getloadavg()
        results = {name: run_config(model, args, name, first) for name in args.configs}
        out = {
            "model": str(model),
            "memory_budget": args.memory_budget,
            "max_context": args.max_context,
            "first_tokens": args.first_tokens,
            "max_tokens": args.max_tokens,
            "questions": QUESTIONS,
            "machine": machine_info(str(model)),
            "versions": {"mlx-lm": version("mlx-lm"), "mlx_flash": version("mlx-flash-runtime")},
            "load_average": {"start": [round(x, 1) for x in load0], "end": [round(x, 1) for x in os.getloadavg()]},
            "results": results,
            "vs_cold": compare(results),
        }
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=1))
    results = out["results"]
    print(header(out))
    print(table(results))
    print()
    print(passes_table(results))
    print()
    print(verdict(results))
    if args.plot:
        plot(out, args.plot)


if __name__ == "__main__":
    main()
