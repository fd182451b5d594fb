"""Perplexity windows as llama.cpp's llama-perplexity forms them (texts.llama_ppl_chunks), scoring from a
position (quality.sequence_nll(first=)), and (where llama.cpp and the default model are already there:
the tests never build or convert them) benchmarks/ppl_check.py against llama-perplexity itself."""

import json
import subprocess
import sys
from pathlib import Path

from mlx_flash.calib.quality import perplexity, sequence_nll
from mlx_flash.default_model import default_model_dir
from mlx_flash.texts import llama_ppl_chunks, token_batches
from mlx_flash.tools import peers_systems

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


class WordTokenizer:
    """Each whitespace-separated word is its integer value; BOS is 1."""

    bos_token_id = 1

    def encode(self, text, add_special_tokens=True):
        return [int(w) for w in text.split()]


def test_llama_chunks_overwrite_each_first_token_with_bos():
    text = " ".join(str(i) for i in range(100, 111))  # 11 tokens; with BOS 12
    rows = llama_ppl_chunks(WordTokenizer(), text, 4)
    # llama-perplexity: [BOS] + tokens, cut into 4-token chunks, chunk[0] := BOS (a text token is lost)
    assert rows.tolist() == [[1, 100, 101, 102], [1, 104, 105, 106], [1, 108, 109, 110]]
    assert llama_ppl_chunks(WordTokenizer(), text, 4, n_chunks=2).shape == (2, 4)
    assert llama_ppl_chunks(WordTokenizer(), text, 4, bos=False).tolist() == [
        [100, 101, 102, 103],
        [104, 105, 106, 107],
    ]
    # mlx_flash's own windows insert BOS instead: no text token is lost
    assert token_batches(WordTokenizer(), text, 3, 2).tolist() == [[1, 100, 101, 102], [1, 103, 104, 105]]
    with pytest.raises(ValueError):
        llama_ppl_chunks(WordTokenizer(), "5 6", 4)


class FixedLogits(nn.Module):
    """logits[t] = table[token t]: a bigram model."""

    def __init__(self, table):
        super().__init__()
        self.table = mx.array(table)

    def __call__(self, x):
        return self.table[x]


def test_sequence_nll_scores_from_first():
    rng = np.random.default_rng(0)
    table = rng.normal(size=(16, 16)).astype(np.float32)
    rows = rng.integers(0, 16, size=(3, 9)).astype(np.int32)
    logp = table - np.log(np.exp(table).sum(1, keepdims=True))
    nll = -logp[rows[:, :-1], rows[:, 1:]]  # [3, 8]: nll[:, j] predicts rows[:, j + 1]
    model = FixedLogits(table)
    assert sequence_nll(model, None, rows) == pytest.approx(nll.mean(), rel=1e-5)
    assert sequence_nll(model, None, rows, first=4) == pytest.approx(nll[:, 4:].mean(), rel=1e-5)
    seen = []
    ppl = perplexity(model, None, rows, first=7, on_logits=lambda i, lg: seen.append((i, lg.shape)))
    assert ppl == pytest.approx(np.exp(nll[:, 7:].mean()), rel=1e-5)
    assert seen == [(0, (1, 16)), (1, (1, 16)), (2, (1, 16))]
    with pytest.raises(ValueError):
        sequence_nll(model, None, rows, first=8)


def _llama_perplexity():
    exe = peers_systems.llama_cpp_path("llama-perplexity")
    return exe if exe.is_file() else None


@pytest.mark.skipif(
    _llama_perplexity() is None or not (default_model_dir() / "flash.json").is_file(),
    reason="llama-perplexity not built or the default model not converted (python -m mlx_flash.peers does both)",
)
def test_mlx_flash_matches_llama_perplexity(tmp_path):
    """Same GGUF, same tokens, same scored positions: token ids identical, perplexity within 2%."""
    out = tmp_path / "ppl.json"
    r = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "ppl_check.py"),
            "--ctx",
            "128",
            "--chunks",
            "2",
            "--systems",
            "mlx_flash eval",
            "--selectors-windows",
            "0",
            "--quiet",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["tokens"]["ids_differing"] == 0 and res["tokens"]["scored_tokens"] == 2 * 63
    llama, flash = res["rows"]
    assert llama["system"] == "llama-perplexity" and flash["system"] == "mlx_flash eval"
    assert abs(flash["rel_diff"]) < 0.02
    assert flash["llama_ppl_decoded"] == pytest.approx(llama["ppl"], rel=1e-3)  # the log-prob file read right
    assert flash["top1_agreement"] > 0.9 and flash["kld"] < 0.05
