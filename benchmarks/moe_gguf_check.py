"""MoE GGUFs as llama.cpp writes them, checked against llama.cpp itself (issue #23): for each architecture a tiny
random GGUF (mlx_flash.tools.synthetic_gguf.tiny_moe: qwen3moe; Mixtral, llama.cpp's "llama" with experts; qwen2moe,
with a shared expert; olmoe; gpt-oss, MXFP4 experts with biases, sinks, sliding layers, YaRN; deepseek2, MLA,
grouped sigmoid routing, YaRN), converted with convert's defaults, then benchmarks/ppl_check.py against
llama-perplexity on the same tokens: perplexity, KL per token and top-1 agreement of mlx_flash's resident model.

    python benchmarks/moe_gguf_check.py [--out benchmarks/results/moe_gguf_check.json]

The tests check the conversion against mlx-lm on the same weights; this checks the mapping (names, RoPE
permutations, the shared expert's gate, MXFP4's nibbles, YaRN) against an independent implementation. Random
weights: mapping only, the perplexities are near the vocabulary size.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from mlx_flash.convert.build import convert
from mlx_flash.tools.synthetic_gguf import MOE_TYPES, tiny_moe, write_gguf


def setup_arg_parser():
    p = argparse.ArgumentParser(description="Tiny MoE GGUFs: mlx_flash against llama-perplexity.")
    p.add_argument("--model-types", default=",".join(MOE_TYPES))
    p.add_argument("--out", default="benchmarks/results/moe_gguf_check.json")
    return p


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for model_type in args.model_types.split(","):
            gguf = write_gguf("moe-small", Path(tmp) / f"{model_type}.gguf", progress=False, **tiny_moe(model_type))
            flash = convert(str(gguf), Path(tmp) / f"{model_type}-flash", progress=False)
            out = Path(tmp) / f"{model_type}.json"
            subprocess.run(
                [
                    sys.executable,
                    str(Path(__file__).with_name("ppl_check.py")),
                    "--gguf",
                    str(gguf),
                    "--model",
                    str(flash),
                    "--ctx",
                    "64",
                    "--chunks",
                    "4",
                    "--systems",
                    "mlx_flash resident",
                    "--selectors-windows",
                    "0",
                    "--quiet",
                    "--out",
                    str(out),
                ],
                check=True,
            )
            results[model_type] = json.loads(out.read_text())
    Path(args.out).write_text(json.dumps({"configs": {t: tiny_moe(t) for t in results}, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
