"""A pipeline stage's share of a flash directory: layers [start, stop) seen as a model of their own.

mlx_flash.pipeline runs one model over several processes (mx.distributed), each holding a contiguous run of its
layers. `StageDir` presents that run to the loader as a flash directory of stop - start layers: the config's layer
count, the regions and FFN paths numbered from 0, the resident tensors of its layers renamed to match (the same
bytes of the same files: offsets stay the directory's), and of the tensors outside the layers only those the stage
uses: the embedding on the first stage, the final norm and the LM head on the last (a tied head: the embedding
too). Planning, streaming, the unit caches and the native decode step then see a smaller model, and count, read
and hold only the stage's bytes. The modules a stage does not hold become `Absent` (engine/resident.py) in its model
(`absent_modules`).
"""

from dataclasses import replace
from typing import Callable, Dict

import mlx.nn as nn
from mlx.utils import tree_flatten

from ..engine.resident import EMBEDDINGS, LINEARS, Absent
from ..errors import FlashError, UnsupportedArchitectureError
from ..format.config import LAYERS
from ..format.directory import FlashDir
from .inspect import instantiate


def layer_paths(model: nn.Module) -> list:
    """The module path of each of a model's layers ("model.layers.0", ...)."""
    names = {id(m): p for p, m in model.named_modules()}
    return [names[id(layer)] for layer in model.layers]


def _shapes(module: nn.Module) -> list:
    """What a layer is made of: its modules' classes and its parameters' shapes (lazy: nothing is read)."""
    return [type(m).__name__ for _, m in module.named_modules()] + [
        (k, tuple(v.shape)) for k, v in tree_flatten(module.parameters())
    ]


class StageDir(FlashDir):
    """Layers [start, stop) of an opened FlashDir as a flash directory of their own (module doc)."""

    def __init__(self, fd: FlashDir, start: int, stop: int):
        self.__dict__.update(fd.__dict__)  # opened and checked already: nothing is read again
        n = len(fd.layers)
        if not 0 <= start < stop <= n:
            raise FlashError(f"pipeline stage: layers {start}..{stop - 1} are not within the model's {n} layers")
        if "text_config" in fd.config:
            raise UnsupportedArchitectureError(
                "pipeline stages: a multimodal wrapper's language model is not supported"
            )
        self.full, self.start, self.stop = fd, start, stop
        self.first, self.last = start == 0, stop == n
        config = dict(fd.config)
        for key in LAYERS:
            if key in config:
                config[key] = stop - start
        full, own = instantiate(fd.config), instantiate(config)
        paths = layer_paths(full)
        for i in range(start, stop):  # (a config whose layers differ by index, e.g. every k-th sparse, would shift)
            if _shapes(full.layers[i]) != _shapes(own.layers[i - start]):
                raise UnsupportedArchitectureError(
                    f"pipeline stages: {fd.architecture}'s layer {i} differs from layer {i - start} of a "
                    f"{stop - start}-layer model of the same config (layers that depend on their index)"
                )
        self._prefixes = {paths[i] + ".": paths[i - start] + "." for i in range(start, stop)}
        self.absent = self._outside(full, paths)
        self.config = config
        self.layers = [
            {k: replace(r, layer=r.layer - start) for k, r in fd.layers[i].items()} for i in range(start, stop)
        ]
        ffn = dict(fd.ffn)
        if "mlp_paths" in ffn:
            ffn["mlp_paths"] = [self._rename(p + ".")[:-1] for p in ffn["mlp_paths"][start:stop]]
        if "switch_paths" in ffn:
            ffn["switch_paths"] = {
                str(int(i) - start): self._rename(p + ".")[:-1]
                for i, p in ffn["switch_paths"].items()
                if start <= int(i) < stop
            }
        self.manifest = dict(fd.manifest, ffn=ffn, sparsity=None)  # (a selector's arrays are the whole model's)
        self._resident_index = None

    def _outside(self, model: nn.Module, paths) -> set:
        """The module paths outside the layers this stage does not hold: the embedding on the first stage (and the
        last, if the head is tied to it), every other one (final norm, LM head) on the last."""
        index = self.full.resident_index()
        held = {name.rsplit(".", 1)[0] for name in index}
        outside = [
            (p, m) for p, m in model.named_modules() if p in held and not any(p.startswith(q + ".") for q in paths)
        ]
        embeddings = [p for p, m in outside if isinstance(m, EMBEDDINGS)]
        vocab = {index[p + ".weight"].shape[0] for p in embeddings}
        tied = not any(isinstance(m, LINEARS) and index[p + ".weight"].shape[0] in vocab for p, m in outside)
        absent = set()
        for p, _ in outside:
            if p in embeddings:
                keep = self.first or (self.last and tied)
            else:
                keep = self.last
            if not keep:
                absent.add(p)
        self.tied_head = tied
        return absent

    def _rename(self, name: str):
        """A tensor (or `path.`) name in the stage's numbering; None if the stage does not hold it."""
        for old, new in self._prefixes.items():
            if name.startswith(old):
                return new + name[len(old) :]
        if name.rsplit(".", 1)[0] in self.absent or any(name.startswith(p + ".") for p in self.absent):
            return None
        layer_prefix = next(iter(self._prefixes))[:-1].rsplit(".", 1)[0] + "."  # e.g. "model.layers."
        return None if name.startswith(layer_prefix) else name  # another stage's layer

    def resident_index(self):
        if self._resident_index is None:
            self._resident_index = {
                new: replace(t, name=new) for k, t in self.full.resident_index().items() if (new := self._rename(k))
            }
        return self._resident_index

    def load_resident(self, biases: bool = True):
        arrays = self.full.load_resident(biases)  # lazy (mx.load): only the tensors kept are ever read
        return {new: v for k, v in arrays.items() if (new := self._rename(k))}

    @property
    def symmetric(self) -> Dict[str, int]:
        return {new[:-1]: b for p, b in self.full.symmetric.items() if (new := self._rename(p + "."))}

    @property
    def model_bytes(self) -> int:
        """The stage's share of the model (what a "50%" budget is a share of on this stage)."""
        resident = sum(t.nbytes for t in self.resident_index().values())
        return resident + sum(r.n_units * self.layouts[r.name].nbytes for r in self.regions())

    def unit_checksums(self):
        full = self.full.unit_checksums()
        if full is None:
            return None
        return {(i - self.start, name): v for (i, name), v in full.items() if self.start <= i < self.stop}


def absent_modules(fd: FlashDir) -> Dict[str, Callable[[nn.Module], nn.Module]]:
    """The loader's wrappers (module path -> replacement) of the modules a stage does not hold; {} for a model."""
    return {p: (lambda m, p=p: Absent(p)) for p in getattr(fd, "absent", ())}
