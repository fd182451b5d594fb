"""Conversion sources: a local mlx-lm / Hugging Face directory, a hub id, or a GGUF file.

Every source becomes a local mlx-lm model directory, so one code path loads them all.
"""

import json
import os
import re
import shutil
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..compute import blocks
from ..errors import SourceError, UnsupportedArchitectureError
from ..format.quant import symmetric_biases
from ..format.safetensors_io import read_header as safetensors_header
from ..models import get_model_classes
from ..models.architectures import adapter_for
from ..models.inspect import is_moe
from .gguf import BLOCKS, IN_PLACE, SYMMETRIC, gguf_to_mlx_dir

TOKENIZER_FILES = (
    "tokenizer*",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "*.tiktoken",
    "chat_template.*",
    "generation_config.json",
)


# `org/name` as the Hub spells it (ASCII letters, digits, '-', '_', '.'; no part starts with '.').
HUB_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*/[A-Za-z0-9_-][A-Za-z0-9_.-]*")


def is_hub_id(src: str) -> bool:
    """Whether a source that is no file or directory here is a Hub id: `org/name`, not ending in .gguf or
    .safetensors. Anything else is a missing path; so is `./models/smol`, while a missing `models/smol` is an id."""
    return HUB_ID.fullmatch(src) is not None and not src.endswith((".gguf", ".safetensors"))


def _is_gguf(path: Path) -> bool:
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def resolve_source(
    src, workdir: Path, progress: bool = False, experts_in_place: bool = False, ffn_holes: bool = False
) -> Path:
    """Return a local mlx-lm model directory for `src`. GGUF files are unpacked into `workdir`, a shard per layer:
    `experts_in_place`, their experts of GGML block types left in the file (gguf.IN_PLACE); `ffn_holes`, a dense
    FFN converted only when each layer is reached (gguf.FFNHoles)."""
    path = local_source(str(src))
    if not path.is_file():
        return path
    return gguf_to_mlx_dir(
        path,
        workdir / "gguf-source",
        progress=progress,
        experts_in_place=experts_in_place,
        by_layer=True,
        ffn_holes=ffn_holes,
    )


def local_source(src: str) -> Path:
    """`src` as a local GGUF file or model directory (a hub id is downloaded, into the Hub's cache); SourceError if
    it is neither."""
    path = Path(src).expanduser()
    if path.is_file():
        if not _is_gguf(path):
            raise SourceError(f"{path}: not a GGUF file (expected a model directory, a hub id or a .gguf file)")
        return path
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SourceError(f"{path}: no config.json (not a Hugging Face / mlx-lm model directory)")
        return path
    if is_hub_id(src):
        return _download(src)
    raise SourceError(f"no such file or directory: {src}")


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                repo_id,
                allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"],
            )
        )
    except Exception as e:  # offline, unknown repo, gated repo: all end the same way
        detail = " ".join(str(e).split())  # (the Hub's messages run over several lines)
        raise SourceError(
            f"{repo_id}: no such file or directory, and cannot fetch it from the Hugging Face Hub "
            f"({type(e).__name__}: {detail})"
        ) from e


def read_config(model_dir: Path) -> dict:
    try:
        with open(model_dir / "config.json") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise SourceError(f"{model_dir / 'config.json'}: cannot be read ({e})") from e


def load_source_model(model_dir: Path, lazy: bool = True):
    """Load an mlx-lm model directory: (model, config). Unsupported architectures fail before any weight is read."""
    from mlx_lm.utils import load_model

    config = read_config(model_dir)
    if not is_moe(config):
        adapter_for(config)
    symmetric, kept = Path(model_dir) / SYMMETRIC, Path(model_dir) / BLOCKS
    try:  # (experts left in a GGUF are not in the directory: the model's own stand in, lazy, never computed)
        strict = not ((Path(model_dir) / IN_PLACE).is_file() or symmetric.is_file() or kept.is_file())
        model, config = load_model(model_dir, lazy=lazy, strict=strict, get_model_classes=get_model_classes)
    except UnsupportedArchitectureError:
        raise
    except FileNotFoundError as e:
        raise SourceError(f"{model_dir}: {e}") from e
    except Exception as e:
        raise SourceError(f"{model_dir}: cannot load the model ({type(e).__name__}: {e})") from e
    modules = dict(model.named_modules())
    if kept.is_file():  # their GGML blocks loaded as they are (load_weights leaves strict shapes to us)
        for path, kind in json.loads(kept.read_text()).items():
            blocks.keep_blocks(modules[path], kind)
    if symmetric.is_file():  # (lazily, from the scales: read when used)
        for name in json.loads(symmetric.read_text()):
            modules[name].biases = symmetric_biases(modules[name].scales, modules[name].bits)
        if not lazy:
            mx.eval(model.parameters())
    return model, config


def tokenizer_files(src: Path) -> list:
    return [f for pattern in TOKENIZER_FILES for f in src.glob(pattern) if f.is_file()]


def copy_tokenizer(src: Path, dst: Path) -> None:
    for f in tokenizer_files(src):
        shutil.copy2(f, dst / f.name)


def mlp_paths(model: nn.Module):
    """Dotted parameter path of each layer's mlp (e.g. 'model.layers.3.mlp')."""
    names = {id(m): name for name, m in model.named_modules()}
    return [names[id(layer.mlp)] for layer in model.layers]


def release(model: nn.Module) -> None:
    """Drop every module's references to its arrays (the model is unusable afterwards), so that arrays handed on
    elsewhere are freed as soon as those are dropped."""
    for _, m in model.named_modules():
        m.clear()


class Unlinked:
    """A GGUF's mlx-lm directory once its model is loaded (lazily), its shards but `keep` unlinked: MLX holds each
    open until it has read its arrays, so each one's disk space is freed as soon as they are no longer needed."""

    def __init__(self, model_dir: Path, keep=()):
        self.dir = Path(model_dir)
        self.shard, self.left, self.size = {}, {}, {}  # array -> its shard; shard -> arrays not read, bytes on disk
        for f in self.dir.glob("model*.safetensors"):
            if f.name in keep:
                continue
            names = {k for k in safetensors_header(f) if k != "__metadata__"}
            self.shard.update(dict.fromkeys(names, f.name))
            self.left[f.name], self.size[f.name] = names, f.stat().st_blocks * 512
            f.unlink()

    def evaluate(self, name: str, a: mx.array, timeout: float = 5.0) -> None:
        """Evaluate `a`; where it was the last array of its shard to be read, return once the filesystem has freed
        the shard (or `timeout` has passed): MLX closes it from its io threads a moment after it is read (later on a
        loaded machine), and the filesystem frees it after that, so writing at once could find it still on disk."""
        f = self.shard.pop(name, None)
        if f is not None:
            self.left[f].discard(name)
        last = f is not None and not self.left[f]
        free = _free(self.dir) if last else 0
        mx.eval(a)
        if not last:
            return
        size, deadline = self.size.pop(f), time.monotonic() + timeout
        while _free(self.dir) < free + size and time.monotonic() < deadline:
            time.sleep(0.001)


def _free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bfree * st.f_frsize
