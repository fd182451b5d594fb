"""A Hugging Face tokenizer built from a GGUF's vocabulary metadata (see gguf.py's doc for the kinds it knows)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Tuple

from ..errors import SourceError
from .gguf_archs import Meta


def portable_tokenizer_config(out_dir: Path, tokenizer) -> None:
    """Name the class transformers 4.x and 5.x both know, and keep the chat template in the config too."""
    p = out_dir / "tokenizer_config.json"
    with open(p) as f:
        cfg = json.load(f)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    if tokenizer.chat_template:
        cfg["chat_template"] = tokenizer.chat_template
    with open(p, "w") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False)


# --------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------

# GPT-2's split regex (the default of tokenizers' ByteLevel pre-tokenizer).
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> pre-tokenizer recipe, following llama.cpp's llama-vocab.cpp regexes.
_PRE_TOKENIZERS = {
    # "\p{N}" isolated, then the GPT-2 regex == Digits(individual_digits) + ByteLevel (SmolLM2's tokenizer.json)
    **{k: "digits+gpt2" for k in ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva-7b")},
    **{k: "gpt2" for k in ("gpt-2", "gpt2", "default", "mpt", "olmo", "jais")},
    **{k: "llama3" for k in ("llama-bpe", "llama3", "smaug-bpe", "dbrx")},
    **{k: "qwen2" for k in ("qwen2", "stablelm2")},
}

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
_TOKEN_NORMAL, _TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER_DEFINED, _TOKEN_UNUSED, _TOKEN_BYTE = 1, 2, 3, 4, 5, 6


def _pre_tokenizer(kind: str):
    from tokenizers import Regex, pre_tokenizers

    if kind == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if kind == "digits+gpt2":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
            ]
        )
    regex = {"llama3": _LLAMA3_REGEX, "qwen2": _QWEN2_REGEX}[kind]
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )


def _gpt2_model(meta: Meta, tokens: List[str], vocab: Dict[str, int]):
    """Byte-level BPE (tokenizer.ggml.model == "gpt2") from tokens + merges."""
    from tokenizers import Tokenizer, decoders, models, processors

    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise SourceError(
            f"{meta.path}: pre-tokenizer {pre!r} is not supported (known: {', '.join(sorted(_PRE_TOKENIZERS))})"
        )
    pairs = []
    for m in meta.get("tokenizer.ggml.merges") or []:
        a, sep, b = m.partition(" ")
        if not sep:
            raise SourceError(f"{meta.path}: malformed merge {m!r} in tokenizer.ggml.merges")
        pairs.append((a, b))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(_PRE_TOKENIZERS[pre])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok, False


def _spm_merges(vocab: Dict[str, int], scores: List[float]) -> List[Tuple[str, str]]:
    """BPE merges that reproduce a SentencePiece BPE model: every split of a piece into two pieces,
    ranked by the merged piece's score (what transformers' SentencePieceExtractor does)."""
    merges = []
    for piece, i in vocab.items():
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                merges.append((-scores[i], -len(left), -len(right), i, vocab[left], vocab[right], left, right))
    merges.sort()
    return [(m[-2], m[-1]) for m in merges]


def _spm_model(meta: Meta, tokens: List[str], vocab: Dict[str, int]):
    """SentencePiece BPE (tokenizer.ggml.model == "llama", Llama 1/2, Mistral, TinyLlama) as a
    byte-fallback BPE, the way transformers' LlamaTokenizerFast (legacy) does it."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = [float(x) for x in (meta.get("tokenizer.ggml.scores") or [])]
    if len(scores) != len(tokens):
        raise SourceError(f"{meta.path}: SentencePiece tokenizer without one score per token (tokenizer.ggml.scores)")
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None else None
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=_spm_merges(vocab, scores), unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    replace = normalizers.Replace(" ", "\u2581")
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), replace]) if add_prefix else replace
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    return tok, True


_TOKENIZER_MODELS = {"gpt2": _gpt2_model, "llama": _spm_model}


def build_tokenizer(meta: Meta):
    """transformers.PreTrainedTokenizerFast rebuilt from GGUF tokenizer metadata."""
    from tokenizers import AddedToken, processors
    from transformers import PreTrainedTokenizerFast

    path = meta.path
    model = meta.get("tokenizer.ggml.model")
    if model not in _TOKENIZER_MODELS:
        raise SourceError(
            f"{path}: tokenizer model {model!r} is not supported (supported: {', '.join(sorted(_TOKENIZER_MODELS))})"
        )
    tokens = [str(t) for t in (meta.get("tokenizer.ggml.tokens") or [])]
    if not tokens:
        raise SourceError(f"{path}: no tokenizer.ggml.tokens in the GGUF metadata")
    types = list(meta.get("tokenizer.ggml.token_type") or [_TOKEN_NORMAL] * len(tokens))
    vocab: Dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # keep the first id of a duplicated string
    tok, add_bos_default = _TOKENIZER_MODELS[model](meta, tokens, vocab)

    added = [
        AddedToken(
            t, special=ty != _TOKEN_USER_DEFINED, normalized=False, single_word=False, lstrip=False, rstrip=False
        )
        for i, (t, ty) in enumerate(zip(tokens, types))
        if ty in (_TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER_DEFINED) and vocab.get(t) == i
    ]
    if added:
        tok.add_tokens(added)

    def special(name):
        i = meta.get(f"tokenizer.ggml.{name}_token_id")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    bos, eos, unk, pad = special("bos"), special("eos"), special("unknown"), special("padding")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
        pair = single + ([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else [])
        specials = ([(bos, vocab[bos])] if add_bos else []) + ([(eos, vocab[eos])] if add_eos and eos != bos else [])
        tok.post_processor = processors.TemplateProcessing(
            single=" ".join(single), pair=" ".join(pair), special_tokens=specials
        )

    kwargs = dict(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        unk_token=unk,
        pad_token=pad,
        clean_up_tokenization_spaces=False,
        chat_template=meta.get("tokenizer.chat_template") or None,
    )
    ctx = meta.get(f"{meta.get('general.architecture')}.context_length")
    if ctx:
        kwargs["model_max_length"] = int(ctx)
    return PreTrainedTokenizerFast(**{k: v for k, v in kwargs.items() if v is not None})
