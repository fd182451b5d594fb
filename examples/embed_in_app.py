"""Embedding mlx_flash in an application: load in the background, stream tokens, close cleanly.

python examples/embed_in_app.py [--model DIR] [--memory-budget 65%]
"""

import argparse
import threading

import mlx_flash  # before mlx.core: on Linux it loads OpenBLAS

from mlx_lm import stream_generate


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--memory-budget", default="65%")
    p.add_argument("--prompt", default="Tell me a short fact about octopuses.")
    args = p.parse_args()

    loaded, failed = {}, {}

    def background_load():  # keep the UI thread free while weights load
        try:
            loaded["model"], loaded["tokenizer"] = mlx_flash.load(
                args.model, memory_budget=args.memory_budget, context=256
            )
        except mlx_flash.FlashError as e:  # BudgetError, FlashFormatError, ... are all FlashErrors
            failed["error"] = e

    t = threading.Thread(target=background_load)
    t.start()
    t.join()
    if failed:
        raise SystemExit(f"could not load the model: {failed['error']}")

    model, tokenizer = loaded["model"], loaded["tokenizer"]
    try:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
        for response in stream_generate(model, tokenizer, prompt, max_tokens=48):
            print(response.text, end="", flush=True)
        print()
        s = model.flash.stats.summary()
        print(
            f"[{s['tokens']} tokens, {s['total_ms']:.0f} ms/token, {s['bytes_per_token'] / 2**20:.1f} MiB read/token]"
        )
    finally:
        model.flash.close()  # releases the file and the reader threads


if __name__ == "__main__":
    main()
