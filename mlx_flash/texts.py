"""Texts for calibration and evaluation: the bundled WikiText-2 test split, reading, token windows.

The package carries its own text (`mlx_flash/data/wikitext-2`, CC BY-SA 3.0, see its README), so
calibration, pruning, traces and perplexity work in any install. The first half calibrates, the
second half is held out. A user's own text files are arguments, never defaults.

Two ways to cut a text into evaluation windows:
  token_batches      mlx_flash's own: BOS + seq_len text tokens per window, every position scored
  llama_ppl_chunks   llama.cpp's llama-perplexity: n_ctx-token chunks of the tokenized text, each
                     chunk's first token replaced by BOS, only the second half of each scored
                     (quality.perplexity(..., first=n_ctx // 2)); benchmarks/ppl_check.py compares them
"""

from importlib import resources
from pathlib import Path
from typing import Sequence

import numpy as np


def wikitext() -> Path:
    """The bundled WikiText-2 test split (a file inside the installed package)."""
    return Path(str(resources.files("mlx_flash") / "data" / "wikitext-2" / "test.txt"))


def read_text(paths: Sequence = None, half: str = "all") -> str:
    """Concatenated text of `paths` (default: WikiText-2 test), each cut to its first or second half
    (by characters, at a line break)."""
    parts = []
    for p in paths or [wikitext()]:
        text = Path(p).read_text()
        if half != "all":
            cut = text.find("\n", len(text) // 2)
            cut = len(text) // 2 if cut < 0 else cut + 1
            text = text[:cut] if half == "first" else text[cut:]
        parts.append(text)
    return "\n".join(parts)


def token_batches(tokenizer, text: str, seq_len: int, n_seqs: int, bos: bool = True) -> np.ndarray:
    """[n, seq_len + 1] token windows (inputs + next-token targets), consecutive and non-overlapping.

    Each window starts with the tokenizer's BOS token when it has one (bos=True), as the model saw in
    training, followed by seq_len tokens of text; without a BOS token the windows are seq_len + 1 text
    tokens. The text is tokenized as plain text: WikiText's literal `<unk>` stays text."""
    ids = np.array(tokenizer.encode(text, add_special_tokens=False), dtype=np.int32)
    first = getattr(tokenizer, "bos_token_id", None) if bos else None
    width = seq_len if first is not None else seq_len + 1
    n = min(n_seqs, len(ids) // width)
    if n == 0:
        raise ValueError(f"text too short: {len(ids)} tokens for one sequence of {width}")
    rows = ids[: n * width].reshape(n, width)
    if first is not None:
        rows = np.concatenate([np.full((n, 1), first, dtype=np.int32), rows], axis=1)
    return rows


def llama_ppl_chunks(tokenizer, text: str, n_ctx: int, n_chunks: int = None, bos: bool = True) -> np.ndarray:
    """[n, n_ctx] the chunks llama.cpp's `llama-perplexity -c n_ctx` evaluates (its default, no --ppl-stride).

    It tokenizes the whole text once (special tokens not parsed: `<unk>` stays text), with BOS first
    when the vocabulary adds one (bos=True here; SmolLM2's GGUF says it does not, so llama-perplexity
    needs `--override-kv tokenizer.ggml.add_bos_token=bool:true` to match), cuts the tokens into
    consecutive n_ctx-token chunks (a shorter tail is dropped) and overwrites each chunk's first
    token with BOS. It scores the predictions of positions n_ctx // 2 .. n_ctx - 2, i.e.
    `quality.sequence_nll(model, ctl, chunks, first=n_ctx // 2)`. llama-perplexity drops one trailing
    newline of its -f file; the caller passes the text as llama-perplexity sees it."""
    ids = np.array(tokenizer.encode(text, add_special_tokens=False), dtype=np.int32)
    first = getattr(tokenizer, "bos_token_id", None) if bos else None
    if first is not None:
        ids = np.concatenate([np.array([first], dtype=np.int32), ids])
    n = len(ids) // n_ctx if n_chunks is None else min(n_chunks, len(ids) // n_ctx)
    if n == 0:
        raise ValueError(f"text too short: {len(ids)} tokens for one chunk of {n_ctx}")
    rows = ids[: n * n_ctx].reshape(n, n_ctx).copy()
    if first is not None:
        rows[:, 0] = first
    return rows
