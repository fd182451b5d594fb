"""The README's table of architectures: mlx-lm architecture x source form (Hugging Face float, mlx-community style
4-bit, llama.cpp GGUF) x how the tests check it, built from the tests' own parametrisations (imported), with the
KL figures per token against llama-perplexity from benchmarks/results/moe_gguf_check.json.

    python benchmarks/architectures_table.py [--out benchmarks/results/architectures.md]

A cell names what the test asserts; "-" is a form no test builds for that architecture.
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from mlx_flash.convert.gguf_archs import NOT_CONVERTED  # noqa: E402
from mlx_flash.models.tiny import TINY_MOE_ARCHS  # noqa: E402
from mlx_flash.tools.synthetic_gguf import GGUF_ARCHS  # noqa: E402

import test_convert  # noqa: E402
import test_gguf  # noqa: E402
import test_gguf_moe_archs  # noqa: E402
import test_moe  # noqa: E402
import test_moe_architectures  # noqa: E402
import test_tiny_models  # noqa: E402

FORMS = ("Hugging Face (float)", "mlx-community 4-bit", "GGUF (llama.cpp)")


def parametrised(test, name: str) -> list:
    """The values a test function is parametrised with for argument `name`."""
    for mark in getattr(test, "pytestmark", []):
        if mark.name == "parametrize" and mark.args[0] == name:
            return list(mark.args[1])
    raise LookupError(f"{test.__name__} is not parametrised over {name!r}")


KL_COLUMNS = ("KL vs llama.cpp, Q4_0", "KL vs llama.cpp, F32 copy", "llama.cpp: Q4_0 vs its F32 copy")


def kl_cells(path: Path) -> dict:
    """model_type -> the KL_COLUMNS cells from moe_gguf_check: mlx_flash's KL per token against llama-perplexity on
    the GGUF as written and on its F32 copy, and llama-perplexity's own on the GGUF against its F32 copy."""
    if not path.is_file():
        return {}
    results = json.loads(path.read_text())

    def kl(x, floor="1e-7"):
        return f"{x:.1e}" if x >= float(floor) else f"<{floor}"

    def mlx_flash(run):
        return kl(next(r["kld"] for r in run["rows"] if r["system"] == "mlx_flash resident"))

    f32, own = results.get("runs_f32", {}), results.get("kl_llama_cpp_q4_0_vs_its_f32", {})
    return {
        t: (
            mlx_flash(run),
            mlx_flash(f32[t]) if t in f32 else "-",
            kl(own[t], "1e-6") if t in own else "-",  # llama-perplexity prints 6 decimals
        )
        for t, run in results["runs"].items()
    }


LEGEND = """
What a cell asserts (the test module in parentheses):
- *bit-exact*: every converted bundle holds the source's values, the resident model's logits within 1e-4 of
  mlx-lm's (test_convert); *runs*: mlx-lm runs the tiny model (test_tiny_models).
- *streamed = mlx-lm*: greedy tokens of the model streamed from flash (experts under a budget) = mlx-lm's on the same
  weights; HF: a float directory with a tensor per expert (test_moe); 4-bit: at no budget, 25% and 50% of the experts
  and below the resident floor, logits within 1e-4 (test_moe_architectures, and test_moe for the first six).
- GGUF, `llama.cpp architecture`: dense: weights and tokens = the HF model's conversion (test_gguf); MoE: the
  converted model = mlx-lm's on the GGUF's weights bit for bit, streamed (test_moe), or every weight = the GGUF's
  values and streamed tokens = the cached model's (test_gguf_moe_archs).
- KL: per token on the same tokens (benchmarks/moe_gguf_check.py): mlx_flash against llama-perplexity on the GGUF as
  written (Q4_0; gpt-oss's experts MXFP4) and on its copy dequantised to F32, and llama-perplexity on the GGUF against
  itself on the F32 copy. The last equals the first within 1e-6 but for deepseek_v32 (9.0e-3 / 8.8e-3): llama.cpp's
  8-bit activations moving tokens across near ties of the routers and of deepseek_v32's indexer top-k, not the
  conversion; deepseek_v32's F32 column is llama.cpp's float16 indexer keys.
- *refused*: conversion stops with one line saying why.
- hunyuan_moe is mlx_flash's model type (mlx_flash/models/hunyuan_moe.py): mlx-lm's hunyuan with the top-k weights
  renormalised, as Hunyuan-A13B's reference and llama.cpp route them.
"""


def table(kl_path: Path) -> str:
    rows = {}  # (kind, architecture) -> {form index: cell}

    def cell(kind, arch, form, text):
        rows.setdefault((kind, arch), {})[form] = text

    hf, q4, gg = range(len(FORMS))
    for arch in test_tiny_models.EXPECTED_ARCHS:
        cell("dense", arch, hf, "bit-exact" if arch in test_convert.ARCHS else "runs")
    for arch, gguf_arch, _ in test_gguf.GGUF_ARCHS.values():
        cell("dense", arch, gg, f"`{gguf_arch}`: = HF")

    kls = kl_cells(kl_path)
    for arch in TINY_MOE_ARCHS:
        cell("MoE", arch, hf, "streamed = mlx-lm")
    for arch in [*TINY_MOE_ARCHS, *test_moe_architectures.ARCHS]:
        cell("MoE", arch, q4, "streamed = mlx-lm")
    for arch, (_, why) in test_moe_architectures.REFUSED.items():
        cell("MoE", arch, q4, f"refused: {why.replace('|', '/')}")
    gguf_moe = [*parametrised(test_moe.test_gguf_moe_as_llama_cpp_writes_it, "model_type"), *test_gguf_moe_archs.ARCHS]
    for arch in gguf_moe:
        cell("MoE", arch, gg, f"`{GGUF_ARCHS[arch]}`: streamed")
        for i, text in enumerate(kls.get(arch, ())):
            cell("MoE", arch, len(FORMS) + i, text)
    for gguf_arch, (arch, _) in test_gguf_moe_archs.REFUSED.items():
        why = NOT_CONVERTED.get(gguf_arch, "with exp_probs_b (llama.cpp chooses experts with it, mlx-lm drops it)")
        done = rows.get(("MoE", arch), {}).get(gg)
        cell("MoE", arch, gg, f"{done}; refused {why}" if done else f"`{gguf_arch}`: refused: {why}")

    columns = (*FORMS, *KL_COLUMNS)
    lines = ["| architecture | kind | " + " | ".join(columns) + " |", "|---|---|" + "---|" * len(columns)]
    for kind, arch in sorted(rows, key=lambda k: (k[0] != "dense", k[1].lower())):
        cells = rows[kind, arch]
        lines.append(f"| {arch} | {kind} | " + " | ".join(cells.get(i, "-") for i in range(len(columns))) + " |")
    return "\n".join(lines) + "\n" + LEGEND


def main(argv=None):
    p = argparse.ArgumentParser(description="The README's architecture table, from the tests' parametrisations.")
    p.add_argument("--kl", default=str(ROOT / "benchmarks/results/moe_gguf_check.json"))
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/architectures.md"))
    args = p.parse_args(argv)
    text = table(Path(args.kl))
    Path(args.out).write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
