"""The flash manifest's schema (flash.json), checked when a directory opens, so that whatever reads a field later
can rely on its type and on the layouts, layers and files agreeing: a bad field raises KeyError, TypeError or
ValueError (FlashDir turns them into one FlashFormatError naming the file)."""

from pathlib import Path
from typing import Dict, List

from . import ggml
from .layout import BundleLayout, Extent, Region, is_count, matrix

# The manifest's fields and their JSON types, checked at load so that what reads them later can rely on them
# (optional ones: a tuple of the type and None)
MANIFEST_TYPES = {
    "architecture": str,
    "ffn": dict,
    "alignment": int,
    "unit_alignment": (int, None),
    "layouts": dict,
    "layers": list,
    "resident": {"bytes": int, "sha256": str, "symmetric": (dict, None), "blocks": (dict, None)},  # v5: blocks
    "unit_checksums": ({"file": str, "crc32": int}, None),
    "sparsity": (dict, None),
    "sources": ({"root": str, "files": [dict]}, None),  # v5: units read in place from these files ("." its own)
}
SOURCE_FILE_TYPES = {"name": str, "bytes": int, "mtime_ns": int}
EXTENT_TYPES = {
    "component": str,
    "file": int,
    "offset": int,
    "stride": int,
    "bytes": (int, None),
    "at": (int, None),
    "length": (int, None),  # this layer's component bytes where shorter than its layout's (GGML blocks of a layer)
}
FFN_TYPES = {  # dense, mixture of experts
    False: {
        "kind": str,
        "activation": str,
        "hidden_size": int,
        "intermediate_size": int,
        "matrices": dict,
        "mlp_paths": [str],
    },
    True: {"kind": str, "n_experts": int, "switch_paths": dict, "quantization": dict, "experts_per_token": (int, None)},
}
# An expert's matrices (a SwitchGLU's, a SwitchMLP's): those reading the hidden state, the one writing it
EXPERT_MATRICES = {
    frozenset({"gate_proj", "up_proj", "down_proj"}): (("gate_proj", "up_proj"), "down_proj"),
    frozenset({"fc1", "fc2"}): (("fc1",), "fc2"),
}
FFN_MATRICES = {"glu": ("gate", "up", "down"), "relu": ("fc1", "fc2")}  # what each kind of dense FFN computes with
FFN_ACTIVATIONS = ("silu", "gelu_approx", "relu")
QUANT_BITS = (2, 3, 4, 5, 6, 8)  # code widths MLX's quantised products (and the native kernels') take
MATRIX_TYPES = {"region": str, "transposed": (bool, None), "quantization": ({"bits": int, "group_size": int}, None)}


def _check(obj: dict, types: dict, at: str = "") -> None:
    """TypeError naming the first field of `obj` missing or not of its type in `types` (nested dicts checked too)."""
    if not isinstance(obj, dict):
        raise TypeError(f"{at or 'the manifest'} is not an object")
    for key, want in types.items():
        optional = isinstance(want, tuple)
        want = want[0] if optional else want
        value = obj.get(key)
        if value is None and optional:
            continue
        if key not in obj:
            raise KeyError(f"{at}{key}")
        if isinstance(want, dict):
            _check(value, want, f"{at}{key}.")
        elif isinstance(want, list):  # a list of values of one type
            if type(value) is not list or any(type(v) is not want[0] for v in value):
                raise TypeError(f"field {at}{key} is {value!r}, not a list of {want[0].__name__}")
        elif type(value) is not want:  # (not isinstance: a bool is not an int here)
            raise TypeError(f"field {at}{key} is {value!r}, not a {want.__name__}")


def _regions_of(ffn: dict, layer: int) -> set:
    """The regions a layer has: a dense FFN's matrices' in every layer; "experts" where a layer has experts."""
    if ffn["kind"] == "moe":
        return {"experts"} if str(layer) in ffn["switch_paths"] else set()
    return {spec["region"] for spec in ffn["matrices"].values()}


def check_ggml_lengths(ffn: dict, layers: list, layouts: Dict[str, BundleLayout]) -> None:
    """Each layer's experts of GGML blocks (check_ffn) are its own type's bytes: in place, its extents' lengths."""
    quant = ffn.get("quantization") if ffn["kind"] == "moe" else None
    if not quant or not any(q and "ggml" in q for q in quant.values()):
        return
    for i, regions in enumerate(layers):
        r = regions.get("experts")
        if r is None:
            continue
        comps = r.layout_over(layouts["experts"]).components
        for c in comps:
            q = quant[c.name.rsplit(".", 1)[0]]
            kind = ggml.layer_kinds(q, ffn["switch_paths"]).get(str(i))
            if kind is None or c.shape[1] != ggml.row_bytes(kind, q["values"]):
                raise ValueError(f"layer {i}: expert component {c.name!r} of {c.nbytes} bytes is not {kind} rows")


def check_ffn(ffn: dict, layouts: Dict[str, BundleLayout]) -> None:
    """A dense FFN's matrices are each in a region whose layout holds rows of them as its quantisation says (what
    the backends compute with: layout.row_matrix raises ValueError); an expert's matrices are each as their
    quantisation says."""
    if ffn["kind"] == "moe":
        if not all(type(v) is str for v in ffn["switch_paths"].values()):
            raise TypeError("ffn.switch_paths must map layers to module paths")
        k = ffn.get("experts_per_token")
        if k is not None and not 0 < k <= ffn["n_experts"]:
            raise ValueError(
                f"ffn.experts_per_token {k}: a token routes to 1 to n_experts ({ffn['n_experts']}) experts"
            )
        layout = layouts.get("experts")
        quant = ffn["quantization"]  # every matrix's, None where it is float
        names = {c.name.rsplit(".", 1)[0] for c in layout.components} if layout else set()
        if not names or set(quant) != names:
            raise ValueError(f"ffn.quantization names {sorted(quant)}; the experts' layout has {sorted(names)}")
        comps, shape = {c.name: c for c in layout.components}, {}
        for name in names:
            q, w = quant.get(name), comps.get(f"{name}.weight")
            if q is not None and "ggml" in q:  # GGML blocks as stored (format/ggml.py), a type per layer
                kinds = ggml.layer_kinds(q, ffn["switch_paths"])
                n = q.get("values")
                fits = set(q) == {"ggml", "values"} and is_count(n) and n > 0 and len(comps) == len(names)
                if not fits or w is None or len(w.shape) != 2 or w.dtype != "uint8":
                    raise ValueError(f"expert matrix {name!r}: its components do not match its quantisation {q}")
                if max(ggml.row_bytes(k, n) for k in kinds.values()) != w.shape[1]:
                    raise ValueError(f"expert matrix {name!r}: rows of {w.shape[1]} bytes do not hold {q}")
                shape[name] = (w.shape[0], n)
                continue
            if q is not None:
                _check(q, {"bits": int, "group_size": int}, f"ffn.quantization.{name}.")
            if w is None or len(w.shape) != 2 or (q is not None) != (f"{name}.scales" in comps):
                raise ValueError(f"expert matrix {name!r}: its components do not match its quantisation {q}")
            if q is not None:  # as the kernels take it: codes of a width they have, a table entry per group
                n, groups = w.shape[1] * 32 // max(q["bits"], 1), comps[f"{name}.scales"].shape
                if q["bits"] not in QUANT_BITS or q["group_size"] <= 0 or groups != (w.shape[0], n // q["group_size"]):
                    raise ValueError(f"expert matrix {name!r}: {q} does not fit its codes and scales")
            shape[name] = (w.shape[0], w.shape[1] * 32 // q["bits"] if q else w.shape[1])  # (out, in) dequantised
        first, last = EXPERT_MATRICES.get(frozenset(names), (None, None))
        hidden = ffn.get("hidden_size", shape.get(first, (0, 0))[1])
        if first is None or any(shape[n][1] != hidden for n in first) or shape[last][0] != hidden:
            raise ValueError(f"expert matrices {shape} (out, in) do not compute an expert of {hidden} features")
        if len({shape[n][0] for n in first} | {shape[last][1]}) != 1:
            raise ValueError(f"expert matrices {shape} (out, in) disagree on the expert's width")
        return
    if ffn["activation"] not in FFN_ACTIVATIONS:
        raise ValueError(f"ffn activation {ffn['activation']!r} is not one of {', '.join(FFN_ACTIVATIONS)}")
    need = FFN_MATRICES.get(ffn["kind"])
    if need is None or not set(need) <= set(ffn["matrices"]):
        raise ValueError(f"ffn kind {ffn['kind']!r} with matrices {list(ffn['matrices'])}")
    for name, spec in ffn["matrices"].items():
        _check(spec, MATRIX_TYPES, f"ffn.matrices.{name}.")
        if "quantization" not in spec:
            raise KeyError(f"ffn.matrices.{name}.quantization")
        if spec["region"] not in layouts:
            raise ValueError(f"ffn matrix {name!r} is in a region {spec['region']!r} without a layout")
        q, layout = spec["quantization"], layouts[spec["region"]]
        if q and q.get("resident_scales"):  # the source's codes, their group scales resident
            _check(q, {"bits": int}, f"ffn.matrices.{name}.quantization.")
            n = layout.component(f"{name}.weight").shape[0] * 32 // q["bits"]
        else:
            n = matrix(layout, name, q).n
        want = ffn["hidden_size"] if spec["region"] == "neurons" else ffn["intermediate_size"]  # a unit: a neuron
        if n != want:  # (or, in the dip layout's "inputs", an input dimension)
            raise ValueError(f"ffn matrix {name!r} has rows of {n} values, not {want}")


def _region(layer: int, name: str, r: dict, layouts: Dict[str, BundleLayout], sources: List[dict]) -> Region:
    """A manifest's region, its fields checked: counts where counts belong, the stride its layout's; in place, an
    extent per component of its (dense) layout, every unit's inside its source file."""
    if name not in layouts:
        raise ValueError(f"layer {layer}: region {name!r} has no layout")
    for field in ("offset", "n_units", "stride", "crc32"):
        if not is_count(r[field]) or (field == "n_units" and r[field] == 0):
            raise ValueError(f"layer {layer} region {name}: {field} {r[field]!r} is not a valid count")
    layout = layouts[name]
    if r["stride"] != layout.disk_stride:
        raise ValueError(f"layer {layer} region {name}: stride differs from its layout")
    extents = ()
    if "extents" in r:
        if not sources or layout.encoded:
            raise ValueError(f"layer {layer} region {name}: extents need sources and a dense layout")
        _check({"extents": r["extents"]}, {"extents": [dict]}, f"layer {layer} region {name}.")
        comps = {c.name: c for c in layout.components}
        extents, at = [], 0
        for e in r["extents"]:  # each a window of its file around its component, the windows tiling the row
            _check(e, EXTENT_TYPES, f"layer {layer} region {name} extent.")
            c, nbytes = comps.get(e["component"]), e.get("bytes")
            nbytes = c.nbytes if c is not None and nbytes is None else nbytes
            fields = (e["offset"], e["stride"], nbytes)
            if c is None or not (all(is_count(x) for x in fields) and 0 <= e["file"] < len(sources)):
                raise ValueError(f"layer {layer} region {name}: bad extent {e}")
            inside = e.get("at", 0)  # (where this layer's component lies in its window: the source's alignment)
            length = e.get("length", c.nbytes)
            shorter = is_count(length) and 0 < length < c.nbytes and len(c.shape) == 2 and length % c.shape[0] == 0
            if length != c.nbytes and not shorter:  # (a layer's rows of another GGML type: whole rows, fewer bytes)
                raise ValueError(f"layer {layer} region {name}: bad length in extent {e}")
            if not (is_count(inside) and inside + length <= nbytes):
                raise ValueError(f"layer {layer} region {name}: component {c.name!r} is not inside its extent")
            size = sources[e["file"]]["bytes"]  # (a window may pass the end of its file, its component not)
            if e["offset"] + (r["n_units"] - 1) * e["stride"] + inside + length > size:
                raise ValueError(f"layer {layer} region {name}: extent {e} ends past its file")
            extents.append(Extent(e["file"], e["offset"], e["stride"], nbytes, at, inside, length, size))
            at += nbytes
        if [e["component"] for e in r["extents"]] != [c.name for c in layout.components] or at > layout.stride:
            raise ValueError(f"layer {layer} region {name}: extents for {[e['component'] for e in r['extents']]}")
    return Region(layer, name, r["offset"], r["n_units"], r["stride"], r["crc32"], tuple(extents))


def _named_files(manifest: dict) -> List[str]:
    """The file names a manifest gives (each must name a file inside the directory)."""
    named = [manifest.get("unit_checksums"), (manifest.get("sparsity") or {}).get("predictor")]
    return [d["file"] for d in named if d is not None]


def check_types(m: dict) -> None:
    """Every field a reader relies on is there, of its JSON type."""
    _check(m, MANIFEST_TYPES)
    _check(m["ffn"], FFN_TYPES[m["ffn"].get("kind") == "moe"])
    for name in _named_files(m):
        if Path(name).name != name or name in ("", ".", ".."):
            raise ValueError(f"{name!r} names a file outside the model directory")
    root = (m.get("sources") or {}).get("root", "/")
    if not (Path(root).is_absolute() or root == "."):  # (".": the directory's own ffn.bin, convert --copy)
        raise ValueError(f'sources.root {root!r} is neither an absolute path nor the model directory (".")')
    for f in (m.get("sources") or {}).get("files", []):
        _check(f, SOURCE_FILE_TYPES, "sources.files.")
        if Path(f["name"]).is_absolute() or ".." in Path(f["name"]).parts or f["name"] in ("", "."):
            raise ValueError(f"source file {f['name']!r} is not a name inside the source's root")


def read_layers(m: dict, layouts: Dict[str, BundleLayout]) -> List[Dict[str, Region]]:
    """The layers' regions, numbered in order, each layer with the regions its kind of FFN has."""
    sources = (m.get("sources") or {}).get("files", [])
    layers = [
        {name: _region(i, name, r, layouts, sources) for name, r in l["regions"].items()}
        for i, l in enumerate(m["layers"])
    ]
    if [l["index"] for l in m["layers"]] != list(range(len(layers))):
        raise ValueError("layers are not numbered 0, 1, 2, ... in order")
    for i, regions in enumerate(layers):
        if set(regions) != _regions_of(m["ffn"], i):
            raise ValueError(f"layer {i} has regions {sorted(regions)}, not {sorted(_regions_of(m['ffn'], i))}")
        for name, r in regions.items():
            if r.n_units != _units_of(m["ffn"], name):
                raise ValueError(f"layer {i} region {name}: {r.n_units} units, not {_units_of(m['ffn'], name)}")
    return layers


def _units_of(ffn: dict, region: str) -> int:
    """A region's units: an MoE layer's experts, a dense layer's neurons (or, in the dip layout's "inputs", its
    input dimensions)."""
    if ffn["kind"] == "moe":
        return ffn["n_experts"]
    return ffn["intermediate_size"] if region == "neurons" else ffn["hidden_size"]
