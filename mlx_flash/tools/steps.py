"""One generation timed the same way whatever the system (peers runs every Python system through it):

    python mlx_flash/tools/steps.py mlx_flash|mlx-lm|nunspark ARGS...

runs the system's own command (python -m mlx_flash.generate, python -m mlx_lm generate, nunspark generate) with
ARGS in this process, its token generator wrapped to note when each token arrives, and prints at the end one line
`steps: {...}` (JSON):

  prompt_tokens   the prompt's length as the generator got it
  steps           decode steps: the tokens after the first, which the prompt's pass makes
  tok_s           steps over their time (the first token's arrival to the last's), as llama-bench's tg test counts
  step_ms_mean, step_ms_median   a decode step (speculative systems emit several tokens a pass: median None)
  hit_rate, hit_rate_cold, hit_rate_steady, cache_filled_at   mlx_flash: its caches over the decode steps, before
                  and after the misses first fill them

Run as a script, not as part of the package: importing mlx_flash (it picks the BLAS mlx loads) must not touch
the other systems.
"""

import importlib
import json
import os
import statistics
import sys
import time

# (command module, generator module, generator names, index of the prompt among their arguments)
TARGETS = {
    "mlx_flash": ("mlx_flash.generate", "mlx_flash.generate", ("generate_step", "speculative_generate_step"), 0),
    "mlx-lm": ("mlx_lm.generate", "mlx_lm.generate", ("generate_step", "speculative_generate_step"), 0),
    "nunspark": (
        "nunspark.cli",
        "nunspark.generate",
        ("stream_generate", "ngram_speculative_generate", "speculative_generate", "eagle_speculative_generate"),
        1,
    ),
}


def timed(fn, arrivals: list, meta: dict, prompt_at: int, speculative: bool):
    """`fn`'s generator with each yield's arrival time appended to `arrivals`."""

    def wrapper(*args, **kwargs):
        meta["prompt_tokens"] = len(args[prompt_at]) if len(args) > prompt_at else len(kwargs.get("prompt", ()))
        meta["speculative"] = speculative
        gen = fn(*args, **kwargs)
        try:
            for out in gen:
                arrivals.append(time.perf_counter())
                yield out
        finally:
            gen.close()

    return wrapper


def summary(arrivals, meta) -> dict:
    steps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    out = {
        "prompt_tokens": meta.get("prompt_tokens"),
        "steps": len(steps),
        "tok_s": len(steps) / sum(steps) if steps and sum(steps) > 0 else None,
        "step_ms_mean": 1e3 * statistics.mean(steps) if steps else None,
        "step_ms_median": 1e3 * statistics.median(steps) if steps and not meta.get("speculative") else None,
    }
    out.update(meta.get("cache", {}))
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    system, args = argv[0], argv[1:]
    command, module, names, prompt_at = TARGETS[system]
    arrivals, meta = [], {}
    gen_module = importlib.import_module(module)
    for name in names:
        if hasattr(gen_module, name):
            setattr(
                gen_module, name, timed(getattr(gen_module, name), arrivals, meta, prompt_at, "speculative" in name)
            )
    cli = importlib.import_module(command)
    if system == "mlx_flash":  # its caches' hit rates, from the engine --stats prints
        printer = cli.print_stats

        def print_stats(engine, *a, **k):
            from mlx_flash.tools.routing import engine_hit_rates

            meta["cache"] = engine_hit_rates(engine)
            return printer(engine, *a, **k)

        cli.print_stats = print_stats
    try:
        if system == "mlx-lm":
            sys.argv = ["mlx_lm.generate", *args]
            code = cli.main()
        else:
            code = cli.main(args)
    finally:
        sys.stdout.flush()
        print("\nsteps: " + json.dumps(summary(arrivals, meta)), flush=True)
    return code or 0


if __name__ == "__main__":
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)  # this directory's modules are not top-level ones
    sys.exit(main())
