"""Pipeline stages on one machine (issue 42): ranks against the single process, and what two machines would take.

    python benchmarks/pipeline_stages.py --model DIR --ranks 2,3 --budget 60MiB [--rank-budget 1GiB] \
        --tokens 16 [--isolated] --json benchmarks/results/pipeline_NAME.json

ranks    `python -m mlx_flash.generate --stats` as N ranks of the ring backend on 127.0.0.1 (tools/ranks.py: the
         environment mlx.launch gives them), each under a hard cap of its budget + the baseline, against the single
         process under its own (--budget + the baseline): the text rank 0 prints, each rank's device bytes per decode
         token (summed against the single process's), peak RSS and the per-rank figures --stats gathers. Each rank's
         budget is --rank-budget, or else "matched": what gives its layers the unit caches and read-ahead buffers the
         single process's plan gives them (its own floor + those bytes), so that the bytes compare.
isolated the stages in one process one after the other, each under its own budget (--rank-budget or matched), and the
         whole model under --budget: each stage's I/O and compute per decode token as it would be on a machine of its
         own (no other rank on the cores: on 2 cores the ranks' MLX ring waits spin a core each, so the ranks' own
         figures are inflated). The projection for N machines: the stages in sequence (one sequence has no overlap
         between stages) plus N-1 hops of the hidden rows and rank 0's broadcast of the next token.

Figures are from a shared 2-core VM with other work running; only the bytes and the stages' own times mean anything.
"""

import argparse
import json
import re
import sys
from pathlib import Path

import mlx_flash  # noqa: F401  (OpenBLAS before mlx.core)
from mlx_flash.budget import fixed_bytes, parse_size, plan_memory, with_streamed
from mlx_flash.engine.resident import stream_groups
from mlx_flash.format.directory import FlashDir
from mlx_flash.io import memory
from mlx_flash.loader import cpu_cast, load, load_tokenizer
from mlx_flash.models.inspect import instantiate
from mlx_flash.models.stage import StageDir
from mlx_flash.pipeline import PassClock, split_layers
from mlx_flash.tools.bench_io import machine_info
from mlx_flash.tools.cap import run_capped
from mlx_flash.tools.ranks import run_ranks

import mlx.core as mx

PROMPT = "Tell me a story about a lighthouse."
SIZE = r"([\d.]+ (?:B|KiB|MiB|GiB))"


def size(text: str) -> int:
    return 0 if text.strip() == "0 B" else parse_size(text)


def prompt_ids(path) -> list:
    """The prompt's tokens as generate makes them (the chat template where the tokenizer has one)."""
    tok = load_tokenizer(FlashDir(path))
    if tok.chat_template is None:
        return tok.encode(PROMPT)
    return tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)


def whole_plan(fd, budget: int, context: int):
    """The single process's plan (as load makes it for dense and MoE directories)."""
    cast = cpu_cast
    dense = fd.ffn.get("kind") != "moe"
    return plan_memory(
        fd,
        budget,
        context,
        4,
        resident=fd.resident_nbytes(cast),
        groups=stream_groups(fd, instantiate(fd.config), cast, context),
        prefetch=dense,
    )


def matched_budget(plan, fd, stage: StageDir, context: int) -> int:
    """A stage's budget giving its layers the whole plan's unit caches and read-ahead buffers (tests/test_pipeline.py:
    its floor, with an input embedding streamed by rows as the planner does, + those bytes)."""
    if any(g.kind != "rows" for g in plan.streamed):  # (an input embedding by rows: the stages' floors have it too)
        raise SystemExit("matched budgets need a --budget that keeps the resident weights resident")
    strides = {k: v.stride for k, v in fd.layouts.items()}
    caches = sum(c * strides[r] for layer in plan.capacity[stage.start : stage.stop] for r, c in layer.items())
    caches += 2 * plan.prefetch_rows * strides.get("neurons", 0)
    rows = [
        g
        for g in stream_groups(stage, instantiate(stage.config), cpu_cast, context)
        if g.kind == "rows" and g.nbytes > 2 * g.load_bytes
    ]
    return (
        sum(with_streamed(fixed_bytes(stage, context, 4, resident=stage.resident_nbytes(cpu_cast)), rows).values())
        + caches
    )


def generate_cmd(model, budget, tokens):
    return [sys.executable, "-m", "mlx_flash.generate", "--model", str(model), "--memory-budget", str(budget)] + [
        "--stats",
        "--max-tokens",
        str(tokens),
        "--prompt",
        PROMPT,
    ]


def text_of(stdout: str) -> str:
    return stdout.split("\n==========")[0]


def single(model, budget: int, tokens: int, baseline: int) -> dict:
    r = run_capped(generate_cmd(model, budget, tokens), limit=budget + baseline, drop=[model], timeout=3600)
    if not r.ok:
        raise SystemExit(f"single process failed ({r.returncode}, OOM {r.oom_killed}): {r.stderr[-2000:]}")
    # the per-token lines' MiB with 2 decimals (the summary's figure is rounded to 0.1 GiB on a 7B)
    per_token = [float(m) * 2**20 for m in re.findall(r"\[token +\d+\] .*\| read +([\d.]+) MiB", r.stdout)]
    return {
        "budget": budget,
        "cap": budget + baseline,
        "text": text_of(r.stdout),
        "bytes_per_token": sum(per_token) / len(per_token),
        "peak_rss_above_baseline": r.max_rss - baseline,
        "summary": next(l for l in r.stdout.splitlines() if l.startswith("summary over")),
        "plan": r.stdout.strip().splitlines()[-1],
        "wall_s": r.wall_s,
    }


def ranks_run(model, n: int, budgets, tokens: int, baseline: int) -> dict:
    cmds = [generate_cmd(model, b, tokens) for b in budgets]
    results = run_ranks(n, cmds, limit=[b + baseline for b in budgets], drop=[model], timeout=3600)
    if not all(r.ok for r in results):
        raise SystemExit("ranks failed: " + " | ".join(f"{r.returncode} {r.stderr[-1500:]}" for r in results))
    out = results[0].stdout
    rows = json.loads(next(l for l in out.splitlines() if l.startswith("pipeline stages (JSON): ")).split(": ", 1)[1])
    per_rank = []
    for rank, (row, r) in enumerate(zip(rows, results)):
        per_rank.append(
            dict(
                row,
                rank=rank,
                layers=[int(row["start"]), int(row["stop"]) - 1],
                cap=budgets[rank] + baseline,
                own_peak_above_baseline=row["peak_rss"],  # the rank's VmHWM above its own baseline
                wait4_peak_rss=r.max_rss,
                cgroup_peak=r.cgroup_peak,
                oom_killed=r.oom_killed,
            )
        )
    return {"ranks": n, "text": text_of(out), "per_rank": per_rank, "wall_s": max(r.wall_s for r in results)}


def isolated(model, bounds, budgets, whole_budgets, tokens: int, context: int) -> dict:
    """The stages chained in this process, each timed alone, and the whole model at each of `whole_budgets` (module
    doc). Every model's tokens are counted as a rank's are (pipeline.PassClock)."""
    fd = FlashDir(model)
    ids = prompt_ids(model)

    def run(passes):
        toks, out = list(ids), []
        for _ in range(tokens):
            logits = passes(toks, len(toks) > 1)
            toks = [int(mx.argmax(logits[0, -1]).item())]
            out.append(toks[0])
        return out

    def figures(m):
        s = m.flash.stats.summary()
        return {k: s[k] for k in ("io_ms", "compute_ms", "total_ms", "bytes_per_token", "hit_rate")}

    wholes, want = [], None
    for budget in whole_budgets:
        whole, _ = load(model, memory_budget=budget, context=context)
        cache, clock = whole.make_cache(), PassClock(whole.flash.stats)

        def whole_pass(toks, prompt):
            clock.begin(prompt)
            out = whole.decoder(toks, cache, prompt)
            mx.eval(out)
            clock.done()
            return out

        got = run(whole_pass)
        whole.flash.stats.end()
        wholes.append(dict(figures(whole), budget=budget, plan_resident=whole.flash.plan.resident, tokens=got))
        want = want or got
        whole.flash.close()

    stages = [load(model, memory_budget=b, context=context, layers=lay)[0] for lay, b in zip(bounds, budgets)]
    caches = [m.make_cache() for m in stages]
    clocks = [PassClock(m.flash.stats) for m in stages]

    def chained(toks, prompt):
        x = None
        for i, (m, c, clock) in enumerate(zip(stages, caches, clocks)):
            clock.begin(prompt)
            x = m.decoder.embed(toks) if i == 0 else x
            x = m.decoder.run_layers(x, c, prompt)
            if i == len(stages) - 1:
                x = m.decoder.logits(x, prompt)
                mx.eval(x)
            clock.done()
        return x

    got = run(chained)
    for m in stages:
        m.flash.stats.end()
    out = {
        "tokens_equal": all(w["tokens"] == got for w in wholes),
        "wholes": wholes,
        "stages": [
            dict(figures(m), layers=list(lay), budget=b, plan_resident=m.flash.plan.resident)
            for m, lay, b in zip(stages, bounds, budgets)
        ],
        "hidden_bytes_per_hop": 4 * fd.config["hidden_size"],
    }
    for m in stages:
        m.flash.close()
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--ranks", default="2")
    p.add_argument("--budget", required=True, help="The single process's budget.")
    p.add_argument("--rank-budget", default=None, help="Each rank's budget (default: matched, module doc).")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--isolated", action="store_true", help="Also time the 2 stages alone (module doc).")
    p.add_argument(
        "--isolated-only", action="store_true", help="Only that, into the --json file's `isolated` (a quieter time)."
    )
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    fd = FlashDir(args.model)
    context = len(prompt_ids(args.model)) + args.tokens
    budget = parse_size(args.budget, fd.model_bytes)
    plan = whole_plan(fd, budget, context)

    def budgets_of(bounds):
        if args.rank_budget:
            return [parse_size(args.rank_budget)] * len(bounds)
        return [matched_budget(plan, fd, StageDir(fd, *b), context) for b in bounds]

    def time_stages(report):  # last: models loaded here would raise the ranks' wait4 peaks (their parent's at fork)
        bounds = split_layers(fd, 2)[::-1]  # the first stage (embedding) first
        budgets = budgets_of(bounds)
        wholes = sorted({budget, sum(budgets)})  # one machine with one rank's memory, and with all of theirs
        report["isolated"] = isolated(args.model, bounds, budgets, wholes, args.tokens, context)
        print(f"isolated: {json.dumps(report['isolated'])}", file=sys.stderr)

    if args.isolated_only:
        report = json.loads(args.json.read_text()) if args.json and args.json.exists() else {}
        time_stages(report)
        if args.json:
            args.json.write_text(json.dumps(report, indent=1))
        return
    base = run_capped(memory.baseline_command(args.model)).max_rss
    report = {
        "machine": machine_info(args.model),
        "note": "shared 2-core VM, other work running; ranks share the disk and the cores",
        "model": str(args.model),
        "prompt": PROMPT,
        "tokens": args.tokens,
        "baseline_rss": base,
        "single": single(args.model, budget, args.tokens, base),
        "runs": [],
    }
    print(f"single: {report['single']['summary']}", file=sys.stderr)
    for n in (int(x) for x in args.ranks.split(",")):
        bounds = split_layers(fd, n)
        budgets = budgets_of(bounds)
        run = ranks_run(args.model, n, budgets, args.tokens, base)
        run["text_equal"] = run["text"] == report["single"]["text"]
        total = sum(r["bytes_per_token"] for r in run["per_rank"])
        run["bytes_per_token_sum"] = total
        run["bytes_vs_single"] = total / report["single"]["bytes_per_token"]
        # the cgroup's hard cap held (no OOM kill; its charge, page cache included, at most the cap); the budget: each
        # rank's own peak above its baseline (wait4's RSS also counts shared library pages the cgroup does not charge)
        run["under_caps"] = all(r["cgroup_peak"] <= r["cap"] and not r["oom_killed"] for r in run["per_rank"])
        run["within_budgets"] = all(r["own_peak_above_baseline"] <= r["budget"] for r in run["per_rank"])
        report["runs"].append(run)
        print(
            f"{n} ranks: text equal {run['text_equal']}, bytes/token {total} vs single "
            f"{report['single']['bytes_per_token']} ({run['bytes_vs_single']:.3f}x), under caps {run['under_caps']}, "
            f"within budgets {run['within_budgets']}",
            file=sys.stderr,
        )
    if args.isolated:
        time_stages(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
