"""MoE GGUFs as llama.cpp writes them, checked against llama.cpp itself (issues #23, #40): for each architecture a tiny
random GGUF (mlx_flash.tools.synthetic_gguf.tiny_moe: qwen3moe; Mixtral, llama.cpp's "llama" with experts; qwen2moe,
with a shared expert; olmoe; gpt-oss, MXFP4 experts with biases, sinks, sliding layers, YaRN; deepseek2, MLA,
grouped sigmoid routing, YaRN; glm4moe, half-rotary heads and an MTP block; dots1; minimax-m2; granitemoe;
ernie4_5-moe; llama4, top-1 routing and a layer without RoPE; qwen3next and qwen35moe, gated DeltaNet layers as
llama.cpp's converter rearranges them; hunyuan-moe, top-k renormalised; deepseek32, deepseek2's with the lightning
indexer), converted with convert's defaults, then
benchmarks/ppl_check.py against llama-perplexity on the same tokens: perplexity, KL per token and top-1 agreement of
mlx_flash's resident model, twice: llama-perplexity on the GGUF as written, and on its copy dequantised to F32; and
llama.cpp against itself: llama-perplexity on the F32 copy against its run on the GGUF as written (ppl_check
--llama-f32; "kl_llama_cpp_q4_0_vs_its_f32" in --out); and mlx_flash's decode steps, one token per forward pass with
its default int8 activations, against the GGUF as written (ppl_check's "mlx_flash decode";
"kl_mlx_flash_int8_decode_vs_llama_cpp_q4_0").

    python benchmarks/moe_gguf_check.py [--model-types glm4_moe,llama4] [--out benchmarks/results/moe_gguf_check.json]
        [--update]  (keeps the other model types' results already in --out)
    python benchmarks/moe_gguf_check.py --type Q4_K_M --model-types qwen3_moe \
        --out benchmarks/results/moe_gguf_check_q4_k_m.json

--type writes the files in other block types (synthetic_gguf.TYPES: llama-quantize's Q4_K_M mix, K-quants), their
experts then read in place as the file's blocks; K-quant rows hold whole 256-value blocks, so the hidden and expert
widths are 256 there (K_SHAPE).

The tests check the conversion against mlx-lm on the same weights; this checks the mapping (names, RoPE
permutations, the shared expert's gate, MXFP4's nibbles, YaRN, routing) against an independent implementation.
On the Q4_0 file llama.cpp multiplies with its activations rounded to 8 bits, which moves a token to another expert
where two router scores nearly tie: llama4's top-1 routing and the top-2 of 8 of qwen3next, qwen35moe and
hunyuan-moe show it (KL 2e-3..3e-3; the others use all 8 experts or choose them by exp_probs_b), the F32 copy does
not (its products in float32, as mlx_flash's: KL below 2e-7 for all but deepseek32). llama.cpp on the Q4_0 file
differs from itself on the F32 copy by the same KL as from mlx_flash, within 1e-6, its printed precision (llama4
2.030e-3 / mlx_flash 2.029e-3, qwen3next 2.115e-3 / 2.115e-3, qwen35moe 3.134e-3 / 3.134e-3, hunyuan-moe 2.013e-3 /
2.014e-3; every other architecture too): on the Q4_0 files a KL target measures llama.cpp's activation rounding, not
the conversion. mlx_flash's int8 activations (per block of 32, a few outliers kept in float, in the native
kernels' products) round otherwise and do not fall on llama.cpp's sides of those ties: KL 1.7e-3..2.5e-3 for the
four, 4.1e-3 for deepseek32, within 3e-5 of the float figures for the others (float32 decode steps give the resident
model's KL to 1e-7).
deepseek32's indexer keeps 24 of each query's keys: where the 24th and 25th scores tie or nearly tie (exactly, for 1%
of the queries of this text) llama.cpp keeps another key, more often on the Q4_0 file (its 8-bit activations: KL 9.0e-3
against its own F32 copy, 8.8e-3 against mlx_flash) and on the F32 copy with its float16 indexer keys (1.6e-3 against
mlx_flash); with float32 caches (-ctk f32 -ctv f32) 3e-4, and 0 when the indexer keeps every key (index_topk 64).
Random weights: mapping only, the perplexities are near the vocabulary size.
"""

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from mlx_flash.convert.build import convert
from mlx_flash.tools.synthetic_gguf import GGUF_ARCHS, MOE_TYPES, TYPES, tiny_moe, write_gguf

# llama-perplexity on the file as written (and its F32 copy against it; mlx_flash's decode steps with int8
# activations too) / on its F32 copy
FORMS = {
    "gguf": ["--llama-f32", "--systems", "mlx_flash resident,mlx_flash decode"],
    "f32": ["--f32-gguf", "--systems", "mlx_flash resident"],
}
SELF = "kl_llama_cpp_q4_0_vs_its_f32"  # llama.cpp on the Q4_0 file against itself on the F32 copy
INT8 = "kl_mlx_flash_int8_decode_vs_llama_cpp_q4_0"


def row(run: dict, system: str = "mlx_flash resident") -> dict:
    return next(r for r in run["rows"] if r["system"] == system)


K_SHAPE = {"hidden_size": 256, "moe_intermediate_size": 256}


def setup_arg_parser():
    p = argparse.ArgumentParser(description="Tiny MoE GGUFs: mlx_flash against llama-perplexity.")
    p.add_argument("--model-types", default=",".join(MOE_TYPES))
    p.add_argument("--out", default="benchmarks/results/moe_gguf_check.json")
    p.add_argument("--update", action="store_true", help="Keep the results of other model types already in --out.")
    p.add_argument("--type", default="Q4_0", choices=TYPES, help="The files' block types (synthetic_gguf.TYPES).")
    return p


def ppl_check(gguf: Path, flash: Path, out: Path, extra: list, tries: int = 3) -> dict:
    cmd = [
        sys.executable,
        str(Path(__file__).with_name("ppl_check.py")),
        *("--gguf", str(gguf), "--model", str(flash), "--ctx", "64", "--chunks", "4"),
        *("--selectors-windows", "0", "--quiet", "--out", str(out)),
        *extra,
    ]
    # llama-perplexity's log thread sometimes exits before writing its last chunk and final estimate when the
    # machine is busy (exit 0, no "Final estimate"): asked again. A perplexity outside ppl_check's tolerance (its exit
    # 1, the results written) is a result, its KL in the table
    for i in range(tries):
        out.unlink(missing_ok=True)
        if subprocess.run(cmd).returncode in (0, 1) and out.is_file():
            return json.loads(out.read_text())
    raise RuntimeError(f"ppl_check failed {tries} times: {' '.join(cmd)}")


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    runs = {form: {} for form in FORMS}
    with tempfile.TemporaryDirectory() as tmp:
        for model_type in args.model_types.split(","):
            config = {**tiny_moe(model_type), **(K_SHAPE if args.type != "Q4_0" else {})}
            gguf = write_gguf("moe-small", Path(tmp) / "m.gguf", progress=False, gguf_type=args.type, **config)
            # named by its bytes: ppl_check keeps the F32 copy under the cache by the file's name
            digest = hashlib.sha256(gguf.read_bytes()).hexdigest()[:12]
            gguf = gguf.rename(gguf.with_name(f"{model_type}-{digest}.gguf"))
            flash = convert(str(gguf), Path(tmp) / f"{model_type}-flash", progress=False)
            for form, extra in FORMS.items():
                runs[form][model_type] = ppl_check(gguf, flash, Path(tmp) / f"{model_type}-{form}.json", extra)
    print(
        "| model_type | GGUF architecture | KL / token, GGUF as written | top-1 | KL / token, F32 copy | top-1 "
        "| KL / token, llama.cpp: GGUF vs its F32 copy | top-1 | KL / token, GGUF, int8 decode | top-1 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for t, run in runs["gguf"].items():
        rows = [row(run), row(runs["f32"][t]), row(run, "llama-perplexity, F32 copy"), row(run, "mlx_flash decode")]
        cells = " | ".join(f"{r['kld']:.1e} | {r['top1_agreement']:.3f}" for r in rows)
        print(f"| {t} | {GGUF_ARCHS[t]} | {cells} |")
    results = {
        "type": args.type,
        "configs": {t: {**tiny_moe(t), **(K_SHAPE if args.type != "Q4_0" else {})} for t in runs["gguf"]},
        "runs": runs["gguf"],
        "runs_f32": runs["f32"],
        SELF: {t: row(run, "llama-perplexity, F32 copy")["kld"] for t, run in runs["gguf"].items()},
        INT8: {t: row(run, "mlx_flash decode")["kld"] for t, run in runs["gguf"].items()},
    }
    if args.update and Path(args.out).is_file():
        old = json.loads(Path(args.out).read_text())
        results = {k: {**old.get(k, {}), **v} for k, v in results.items()}
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
