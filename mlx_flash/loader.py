"""Build a model from a flash directory: resident weights into the architecture, FFNs replaced."""

import warnings
from functools import partial
from typing import Callable, Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.cache import KVCache

from .budget import (
    AUTO_HEADROOM,
    AUTO_RESERVE,
    FFN_BOUNCE_BYTES,
    auto_budget,
    ffn_reader_threads,
    fixed_bytes,
    fmt_bytes,
    is_auto,
    kv_tokens,
    longest_context,
    min_streaming_budget,
    parse_size,
    plan_memory,
    scale_copy_bytes,
)
from .compute import blocks, cpu_gemv
from .compute.ffn import ResidentFFN
from .default_model import model_dir
from .engine.experts import REGION, SWITCHES, ExpertEngine, FlashSwitchGLU, next_routers
from .engine.forward import Auto, FloatKVCache, HalfKVCache, MLXForward, QuantizedKVCache, backend_name
from .engine.native_step import PROJECTIONS, HostDecoder, HostKVCache
from .engine.neurons import FlashFFN, NeuronEngine
from .engine.read_ahead import ReadAhead
from .engine.resident import STREAM_THREADS, ResidentStreamer, stream_groups, wrapper_for
from .engine.selectors import load_selector_arrays, wina_norms
from .engine.sparsity import DIP, LOSSY, SPARSITIES, WINA, Dense, Oracle, Predictor, Sketch, dram_bytes
from .errors import BudgetError, BudgetWarning, FlashError, FlashFormatError
from .format.config import head_dim
from .format.directory import MANIFEST, RESIDENT, FlashDir, dense_ffn_weights
from .io import memory
from .io.available import available
from .io.reader import DEFAULT_MAX_GAP_BYTES, open_reader
from .models import get_model_classes
from .models.architectures import adapter_for
from .models.inspect import instantiate
from .models.stage import StageDir, absent_modules


def cpu_float32(name: str) -> bool:
    """Which resident float tensors become float32 on the CPU: all but the scales/biases of quantised
    matrices (a float32 activation already takes MLX's fast path with float16 scales, measured 1.5 vs
    43 ms) except the embedding's, whose output dtype becomes the activations' dtype."""
    return not name.endswith((".scales", ".biases")) or "embed" in name


def cpu_cast(name: str):
    """`cpu_float32` as the cast rule FlashDir.resident_nbytes and offload take: "float32" or None."""
    return "float32" if cpu_float32(name) else None


def _wrap(model: nn.Module, weights: Dict[str, mx.array], wrap) -> Dict[str, mx.array]:
    """Replace the modules `wrap` names (path -> function of the module) and return the weights left to load."""
    if not wrap:
        return weights
    modules = dict(model.named_modules())
    model.update_modules(tree_unflatten([(path, fn(modules[path])) for path, fn in wrap.items()]))
    return {k: v for k, v in weights.items() if not any(k.startswith(path + ".") for path in wrap)}


def _keep_blocks(model: nn.Module, fd: FlashDir) -> None:
    """Make the modules resident.blocks names hold their weights as GGML blocks (compute/blocks.py)."""
    modules = dict(model.named_modules())
    for path, kind in fd.blocks.items():
        try:
            blocks.keep_blocks(modules[path], kind)
        except (KeyError, TypeError, ValueError) as e:
            raise FlashFormatError(f"{fd.path / MANIFEST}: resident.blocks names {path}: {e}") from e


def _quantize(model: nn.Module, weights: Dict[str, mx.array], fd: FlashDir) -> None:
    """Make the modules `weights` holds scales for quantised as stored, with cpu_gemv's classes (decode matvecs on
    the CPU: native kernels, MLX's ops otherwise); symmetric modules hold no biases (those classes derive them: no
    DRAM, no reads)."""
    from mlx_lm.utils import infer_quant_config

    nn.quantize(
        model,
        class_predicate=lambda p, m: (
            hasattr(m, "to_quantized")
            and not blocks.is_blocks(m)
            and f"{p}.scales" in weights
            and infer_quant_config(p, m, weights)
        ),
    )
    cpu_gemv.patch(model)
    modules = dict(model.named_modules())
    for path in fd.symmetric:
        if "biases" not in modules.get(path, {}):
            raise FlashFormatError(f"{fd.path / MANIFEST}: resident.symmetric names {path}, no quantised module")
        modules[path].pop("biases")


def build_model(
    fd: FlashDir,
    make_ffn: Callable[[int, Dict[str, mx.array]], nn.Module],
    dtype=None,
    wrap: Dict[str, Callable[[nn.Module], nn.Module]] = None,
) -> nn.Module:
    """Instantiate the architecture, load the resident weights, and set layers[i].mlp = make_ffn(i, biases_i).

    dtype=mx.float32 casts the float tensors `cpu_float32` selects (the CPU path).
    wrap: module path -> function replacing that module (its weights are then not loaded: engine/resident.py)."""
    config = fd.config
    adapter_for(config)
    model_class, args_class = get_model_classes(config)
    model = model_class(args_class.from_dict(config))
    weights = fd.load_resident(biases=False)
    if dtype is not None:
        weights = {
            k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) and cpu_float32(k) else v
            for k, v in weights.items()
        }
    if hasattr(model, "sanitize"):  # idempotent in mlx-lm; some models set ties from the weights present
        weights = model.sanitize(weights)

    paths = fd.ffn["mlp_paths"]
    ffn_tensors = []  # outside model.parameters() (private to the FFN): evaluated below with them
    if len(paths) != len(model.layers) or len(fd.layers) != len(model.layers):
        raise FlashFormatError(
            f"{fd.path}: manifest has {len(fd.layers)} FFN layers, the model config {len(model.layers)}"
        )
    for i, layer in enumerate(model.layers):
        prefix = paths[i] + "."
        # "fc1.bias" -> "fc1"; other resident FFN tensors ("down.scales": convert --down-bits source) keep their name
        bias = {k[len(prefix) :].removesuffix(".bias"): weights.pop(k) for k in list(weights) if k.startswith(prefix)}
        layer.mlp = make_ffn(i, bias)
        ffn_tensors.append(bias)

    _keep_blocks(model, fd)
    if "quantization" in config:
        _quantize(model, weights, fd)
    return _load_weights(model, weights, fd, wrap, ffn_tensors)


def build_moe_model(
    fd: FlashDir, engine=None, dtype=None, wrap: Dict[str, Callable[[nn.Module], nn.Module]] = None
) -> nn.Module:
    """An MoE model with mlx-lm's classes and the resident weights: each SwitchGLU replaced by the engine's
    FlashSwitchGLU, or (engine None) holding all its experts as read from flash: mlx-lm's own model, the reference.
    wrap: as in `build_model` (streamed modules)."""
    config = fd.config
    model_class, args_class = get_model_classes(config)
    model = model_class(args_class.from_dict(config))
    weights = fd.load_resident(biases=False)
    if dtype is not None:
        weights = {
            k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) and cpu_float32(k) else v
            for k, v in weights.items()
        }
    paths = {int(i): p for i, p in fd.ffn["switch_paths"].items()}
    modules = dict(model.named_modules())
    bad = [p for p in paths.values() if not isinstance(modules.get(p), SWITCHES)]
    if bad:
        raise FlashFormatError(f"{fd.path / MANIFEST}: {bad[0]!r} is not an expert block of the model")
    if engine is None:
        for i, path in paths.items():
            weights.update({f"{path}.{k}": v for k, v in fd.unpack_layer(i).items()})
    else:
        model.update_modules(
            tree_unflatten([(p, FlashSwitchGLU(engine, i, modules[p].activation)) for i, p in paths.items()])
        )
    _keep_blocks(model, fd)
    if "quantization" in config or engine is None:
        _quantize(model, weights, fd)
    return _load_weights(model, weights, fd, wrap)


def _load_weights(model, weights, fd, wrap, *extra) -> nn.Module:
    """The resident weights into the model (wrapped modules as `_wrap`), evaluated with `extra`."""
    weights = _wrap(model, weights, wrap)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise FlashFormatError(f"{fd.path}: resident weights do not match the architecture ({e})") from e
    # now, in this thread: MLX streams are per thread, and a lazy load left for another thread (mlx-lm's
    # server generates in its own) fails there ("no Stream(cpu, 0) in current thread")
    mx.eval(model.parameters(), *extra)
    model.eval()
    return model


def load_resident(path, dtype=None) -> Tuple[nn.Module, FlashDir]:
    """Load a flash directory with every FFN neuron resident (no streaming): the reference model, its KV cache of
    `load`'s dtype (`half_kv`). dtype=mx.float32: the CPU path's activations (see `build_model`)."""
    fd = FlashDir(path)
    if fd.ffn.get("kind") == "moe":
        model = build_moe_model(fd, None, dtype)
    else:

        def make_ffn(i, bias):
            arrays = fd.unpack_layer(i)
            mx.eval(arrays)
            return ResidentFFN(fd.ffn, arrays, bias)

        model = build_model(fd, make_ffn, dtype)
    half = half_kv(fd.config, mx.float32 if dtype is None else dtype, None, exact_by_default())  # (as `load`'s)
    model.make_cache = partial(make_cache, model, half=half)
    return model, fd


def load_tokenizer(fd: FlashDir):
    from mlx_lm.utils import load_tokenizer as _load

    try:
        return _load(fd.path, eos_token_ids=fd.config.get("eos_token_id"))
    except Exception as e:  # transformers raises whatever its tokenizer classes raise
        raise FlashFormatError(f"{fd.path}: no tokenizer can be loaded from it ({type(e).__name__}: {e})") from e


MAX_PPL_INCREASE = 0.10  # what --sparsity auto accepts from a calibrated selector by default


def make_sparsifier(
    fd: FlashDir,
    sparsity: str,
    density=None,
    gamma: float = 1.0,
    threshold=None,
    max_ppl_increase: float = MAX_PPL_INCREASE,
):
    """Build the sparsifier named `sparsity` for a flash directory.

    "auto": the directory's calibrated selector if its perplexity increase, measured at calibration,
    is at most `max_ppl_increase`; otherwise dense. Dense and oracle serve every layout; the lossy
    selectors need the calibration the directory records (a directory calibrated for one refuses another)."""

    calib = fd.manifest.get("sparsity") or {}
    sel = calib.get("selector")
    if sparsity == "auto":
        ok = sel is not None and sel.get("ppl_increase", float("inf")) <= max_ppl_increase
        sparsity = sel["name"] if ok else "dense"
    if sparsity not in SPARSITIES:
        raise FlashError(f"unknown sparsity {sparsity!r} (choose from auto, {', '.join(SPARSITIES)})")
    if sparsity in LOSSY and sel is not None and sel["name"] != sparsity:
        raise FlashError(
            f"{fd.path} is calibrated for --sparsity {sel['name']}, not {sparsity}: "
            f"run python -m mlx_flash.calibrate --selector {sparsity} to change it"
        )
    dip_layout = fd.ffn.get("layout") == "dip"
    if sparsity in ("dip", "wina") and not dip_layout:
        raise FlashError(
            f"--sparsity {sparsity} needs a flash directory converted with --layout dip ({fd.path} is not)"
        )
    if sparsity in ("predictor", "sketch") and dip_layout:
        raise FlashError(
            f"--sparsity {sparsity} needs the neurons layout: {fd.path} has the dip layout "
            "(it serves dense, oracle, dip and wina)"
        )
    n, layers = fd.ffn["intermediate_size"], len(fd.layers)
    own = sel if sel is not None and sel["name"] == sparsity else {}
    if density is not None:
        dens = [float(density)] * layers
    else:
        dens = own.get("density")
    if sparsity == "dense":
        return Dense(n)
    if sparsity == "oracle":
        return Oracle(fd, density, resident=not dip_layout)  # dip layout: the runtime computes the exact GLU
    if sparsity == "predictor":
        weights = fd.load_predictors()
        if weights is None:
            raise FlashError(
                f"{fd.path} has no predictors: run python -m mlx_flash.calibrate --selector predictor first"
            )
        t = threshold if threshold is not None else calib["predictor"].get("threshold", 0.5)
        return Predictor(weights, t, dens[0] if dens else None)
    if sparsity == "sketch":
        if not own:
            raise FlashError(f"{fd.path} has no sketch: run python -m mlx_flash.calibrate --selector sketch first")

        return Sketch(
            load_selector_arrays(fd),
            fd.ffn["activation"],
            own["bits"],
            own["group_size"],
            dens or [0.5] * layers,
            gamma,
        )
    # dip / wina: per-layer input and neuron densities
    legacy = calib.get("dip", {}) if sparsity == "dip" else {}
    if density is not None:
        d_in = d_out = dens
    elif "input_density" in own or "input_density" in legacy:
        d_in = own.get("input_density", legacy.get("input_density"))
        d_out = own.get("neuron_density", legacy.get("neuron_density"))
    else:
        d_in = d_out = [0.5] * layers
    if sparsity == "dip":
        return DIP(list(d_in), list(d_out), gamma)

    norms = wina_norms([dense_ffn_weights(fd, i) for i in range(layers)])
    return WINA(list(d_in), list(d_out), *norms, gamma=gamma)


def region_densities(fd: FlashDir, sparsifier) -> Dict[str, list]:
    """Per region, the fraction of each layer's units the sparsifier uses per token (dense: all); a predictor by
    threshold: the density its calibration measured (1 if none was recorded)."""
    n = len(fd.layers)
    if isinstance(sparsifier, (DIP, WINA)):
        return {"inputs": list(sparsifier.input_density), "neurons": list(sparsifier.neuron_density)}
    d = getattr(sparsifier, "density", None)
    if d is None and not isinstance(sparsifier, Dense):
        d = ((fd.manifest.get("sparsity") or {}).get("selector") or {}).get("density")
    d = [1.0] * n if d is None else [float(d)] * n if np.isscalar(d) else list(d)
    return {name: d for name in fd.layers[0]}


def read_bytes_per_token(
    fd: FlashDir, plan, densities: Dict[str, list], max_gap_bytes: int = DEFAULT_MAX_GAP_BYTES
) -> float:
    """Device bytes per decode token the plan implies, for choosing: a dense token reads exactly the units its
    cache does not hold; a selector's token reads its units as missed (what its window cache keeps of them
    depends on how its choices repeat: SmolLM2's calibrated sketch hit 0.5%) and, with each, the gap before it
    when the pool fills it (gaps under max_gap_bytes are read, not skipped: at density d the gap before a unit
    is (1 - d) / d units long), plus the resident weights streamed every token. Checked against --stats on
    SmolLM2 (benchmarks/auto_vs_dense.py)."""
    total = 0.0
    for regions, caps in zip(fd.layers, plan.capacity):
        for name, r in regions.items():
            d = densities[name][r.layer]
            per_unit = min(1 / max(d, 1e-6), 1 + max_gap_bytes / r.stride)  # units' worth read per unit used
            total += (r.n_units - caps[name] if d >= 1 else min(r.n_units, d * r.n_units * per_unit)) * r.stride
    return total + sum(g.nbytes for g in plan.streamed if g.kind != "rows")


def load(
    path=None,
    memory_budget="auto",
    sparsity: str = "auto",
    window: int = 5,
    policy: str = None,
    density: float = None,
    gamma: float = 1.0,
    threads: int = None,
    direct: bool = True,
    context: Optional[int] = 2048,
    use_metal: bool = None,
    dtype=None,
    sparsifier=None,
    prefetch: Optional[bool] = None,
    kv_bits: int = None,
    kv_group_size: int = 64,
    prompt_caches: int = 0,
    sequences: int = 1,
    max_ppl_increase: float = MAX_PPL_INCREASE,
    draft_model=None,
    layers: Optional[Tuple[int, int]] = None,
    backend: Optional[str] = None,
    exact: bool = False,
    plan_only: bool = False,
):
    """Load a flash directory for streaming: (model, tokenizer), usable with mlx-lm's generate.

    context: the tokens (prompt and generated) the KV cache is planned for; generation (stream_generate) stops
    there. None: the longest the budget holds beside the units (budget.longest_context).
    memory_budget: bytes, "2GB" or "50%" (of the model's size) for weights + caches + KV cache;
    "auto" (the default): every unit cached where the model fits in what the machine can give now (io/available.py),
    else that less a headroom (budget.auto_budget); `model.flash.budget_note` says what it found and chose. None
    caches every unit. If the resident weights do not fit, attention layers, embeddings and
    the LM head are streamed from flash too (engine/resident.py; `model.flash.plan` says what); if even
    that does not fit, raises BudgetError before reading weights. `model.flash` is the engine:
    its `.stats`, and `model.flash.close()`.
    dtype: mx.float32 runs activations in float32 (see `cpu_float32`); the default without Metal,
    where float16 matmuls do not use BLAS (~35x slower). Otherwise the stored dtype is kept.
    sparsifier: an object with the sparsity.py interface (e.g. a `Predictor` trained in memory); it
    replaces `sparsity`/`density`/`gamma`. max_ppl_increase: what "auto" accepts (make_sparsifier).
    `model.flash.attach` swaps engines later.
    prefetch: reads ahead while a layer computes (engine/read_ahead.py); None (the default) and True do, False
    does not. Dense decoding reads the next layer's uncached units (two buffers in the budget); an MoE model reads
    the experts the next layer's router predicts into that layer's cache slots, while such guesses prove right.
    kv_bits: 4 or 8 quantises the KV cache (mlx-lm's QuantizedKVCache, `kv_group_size` elements per
    scale) from the first token; the plan holds it at that size. `model.make_cache()` builds it.
    prompt_caches: room in the budget for this many KV caches of `context` tokens stored between
    requests (the server's prompt cache): `model.flash.plan.prompt_cache` bytes.
    sequences: KV caches of `context` tokens for this many sequences decoded together (the server's batch).
    draft_model: a flash directory with the same tokenizer, loaded resident as `model.draft_model` for
    speculative decoding (generate.stream_generate's draft_model); its memory comes out of the budget.
    layers: (start, stop) loads, plans and streams only those layers (a pipeline stage: models/stage.py), with the
    embedding if start is 0 and the final norm and LM head if stop is the last; a "50%" budget is then of its share.
    backend: "auto" (the default, or MLX_FLASH_BACKEND): `model.forward`, the pass every feature runs
    (engine/forward.py), is MLX's forward with the native CPU step beneath it where that applies; "mlx": MLX's own
    ops alone, the arithmetic a Mac runs (this turns the native kernels off for the process); "native": as auto,
    and an error where the native step cannot run.
    exact: float results (float32 keys and values on the CPU path; the native step's float activations are
    cpu_gemv.set_int8_activations(False)).
    plan_only: return (the budget.Plan, the lines saying why: auto's budget, the sparsity chosen) before any weight is
    read (mlx_flash.doctor).
    """

    fd = FlashDir(model_dir(path))
    if layers is not None:
        fd = StageDir(fd, *layers)
    fd.check_resident()
    tokenizer = load_tokenizer(fd)  # first: its transient peak then comes before the weights, not on top
    memory.mmap_large_blocks()
    baseline = memory.rss()  # what the budget is above (see memory.py)
    memory.reset_peak()
    backend = backend_name(backend)
    if backend == "mlx":
        cpu_gemv.enabled = False  # as on a Mac, where they never run
    if dtype is None and not mx.metal.is_available():
        dtype = mx.float32
    half = half_kv(fd.config, dtype, kv_bits, exact or exact_by_default())
    kv_size = kv_itemsize(dtype, half)
    cast = cpu_cast if dtype == mx.float32 else None

    def everything(context):  # what every unit cached takes (a draft: its directory's size)
        extra = FlashDir(draft_model).model_bytes if draft_model is not None else 0
        fixed = fixed_bytes(
            fd, context, kv_size, extra, fd.resident_nbytes(cast), kv_bits, kv_group_size, prompt_caches, sequences
        )
        return sum(fixed.values()) + fd.ffn_bytes

    budget, budget_note = resolve_budget(memory_budget, fd, everything, context)
    native = native_expected(fd, backend, kv_bits)  # (the forward the plan is made for)
    if context is None:
        resident, groups = fd.resident_nbytes(cast), stream_groups(fd, instantiate(fd.config), cast, 1)
        context = longest_context(
            fd.config, budget, lambda c: min_streaming_budget(fd, c, kv_size, 0, resident, groups)
        )
    draft, draft_bytes = _load_draft(draft_model, fd, context) if draft_model is not None else (None, 0)
    if fd.ffn.get("kind") == "moe":
        if sparsifier is not None or sparsity not in ("auto", "dense"):
            raise FlashError(
                f"sparsity {sparsity!r}: a mixture-of-experts model reads the experts its router picks "
                "(exact); neuron sparsity applies to dense models"
            )
        plan = plan_memory(
            fd,
            budget,
            context,
            kv_size,
            draft_bytes,
            resident=fd.resident_nbytes(cast),
            groups=stream_groups(fd, instantiate(fd.config), cast, context),
            kv_bits=kv_bits,
            kv_group_size=kv_group_size,
            prompt_caches=prompt_caches,
            sequences=sequences,
            native=native,
            prefetch=prefetch is not False,  # (a dense FFN's blocks: budget.every_unit_region)
        )
        if plan_only:
            return plan, [budget_note]
        model = _load_moe(
            fd,
            tokenizer,
            baseline,
            plan,
            context,
            dtype,
            policy or "lru",
            window,
            threads,
            direct,
            kv_bits,
            kv_group_size,
            prefetch is not False,
            half,
            backend,
        )
        model.draft_model = draft
        model.flash.budget_note = budget_note
        return model, tokenizer
    auto = sparsifier is None and sparsity == "auto"
    if sparsifier is None:
        sparsifier = make_sparsifier(fd, sparsity, density, gamma, max_ppl_increase=max_ppl_increase)
    bad_group = kv_group_size not in (32, 64, 128) or head_dim(fd.config) % kv_group_size  # (mx.quantize's sizes)
    if kv_bits is not None and (kv_bits not in (2, 3, 4, 6, 8) or bad_group):
        raise FlashError(
            f"kv_bits={kv_bits}, kv_group_size={kv_group_size}: needs bits in 2, 3, 4, 6, 8 and a "
            f"group size of 32, 64 or 128 dividing the head dimension ({head_dim(fd.config)})"
        )

    def plan_for(sp):
        return plan_memory(
            fd,
            budget,
            context,
            kv_size,
            dram_bytes(sp) + draft_bytes,
            resident=fd.resident_nbytes(cast),
            groups=stream_groups(fd, instantiate(fd.config), cast, context),
            prefetch=prefetch is not False and isinstance(sp, Dense),
            kv_bits=kv_bits,
            kv_group_size=kv_group_size,
            prompt_caches=prompt_caches,
            sequences=sequences,
            native=native,
        )

    why = None
    try:
        plan = plan_for(sparsifier)
    except BudgetError:
        if not auto or isinstance(sparsifier, Dense):
            raise
        why = (
            f"auto: dense, since the calibrated {sparsifier.name}'s {fmt_bytes(sparsifier.nbytes)} of DRAM does not "
            "fit this budget"
        )
        sparsifier = Dense(fd.ffn["intermediate_size"])
        plan = plan_for(sparsifier)
    if auto and not isinstance(sparsifier, Dense):
        # a selector only where it reads fewer bytes than dense at this budget: its DRAM pushes cached units out
        dense = Dense(fd.ffn["intermediate_size"])
        dense_plan = plan_for(dense)
        mine = read_bytes_per_token(fd, plan, region_densities(fd, sparsifier))
        theirs = read_bytes_per_token(fd, dense_plan, region_densities(fd, dense))
        if mine >= theirs:
            why = (
                f"auto: dense, since the calibrated {sparsifier.name} would read {fmt_bytes(mine)} a token at this "
                f"budget against dense's {fmt_bytes(theirs)} (its {fmt_bytes(sparsifier.nbytes)} of DRAM leaves fewer "
                "units cached, and its scattered units read the gaps between them)"
            )
            sparsifier, plan = dense, dense_plan
        else:
            why = (
                f"auto: {sparsifier.name}, {fmt_bytes(mine)} a token at this budget against dense's {fmt_bytes(theirs)}"
            )
    if plan_only:
        return plan, [budget_note, why]
    # (threads other than the plan's: its bounce buffers are threads x FFN_BOUNCE_BYTES of a packed directory)
    reader = fd.open_units(direct=direct, threads=threads or ffn_reader_threads(fd), bounce_bytes=FFN_BOUNCE_BYTES)
    engine = NeuronEngine.from_plan(
        fd, plan, reader, sparsifier, policy or "window", window, use_metal, dtype or mx.float32
    )
    engine.why, engine.budget_note = why, budget_note
    engine.stats.baseline_rss = baseline
    if budget is not None:  # MLX keeps freed buffers for reuse, within the plan's workspace
        mx.set_cache_limit(plan.mlx_cache_limit())

    def make_ffn(i, bias):
        if "fc1" in bias and hasattr(sparsifier, "bias"):  # the ReLU oracle needs fc1's bias
            sparsifier.bias[i] = bias["fc1"]
        return FlashFFN(engine, i, bias)

    model = build_model(fd, make_ffn, dtype, {**_streaming(fd, plan, engine, direct, cast), **absent_modules(fd)})
    model.flash = engine
    engine.context = context  # where generation stops: the KV cache holds no more
    model.forward = make_forward(model, engine, kv_bits, backend, dtype)
    model.make_cache = partial(
        make_cache, model, kv_tokens(context) if budget is not None else None, kv_bits, kv_group_size, half
    )
    model.draft_model = draft
    return model, tokenizer


def resolve_budget(memory_budget, fd, everything: Callable[[int], int], context: Optional[int]):
    """(the budget in bytes or None, a line for --stats or None) for `load`'s memory_budget. "auto": None (every unit
    cached) where `everything(context)` fits in budget.auto_budget of what the machine can give now, else that; an
    explicit budget above what the machine gives is kept, with a BudgetWarning."""
    if memory_budget is None:
        return None, None
    machine = available()
    if not is_auto(memory_budget):
        budget = parse_size(memory_budget, fd.model_bytes)
        if machine.bytes is not None and budget > machine.bytes:
            warnings.warn(
                f"mlx_flash: a memory budget of {fmt_bytes(budget)} is more than this machine can give now "
                f"({machine.describe()}): the system will swap or end the process (--memory-budget auto plans "
                "within what it gives)",
                BudgetWarning,
                stacklevel=3,
            )
        return budget, None
    if machine.bytes is None:
        return None, f"memory: auto: {machine.describe()}; every unit cached, as with no budget"
    room = auto_budget(machine.bytes)
    need = everything(context or longest_context(fd.config, None, None))
    found = f"memory: auto: this machine can give {fmt_bytes(machine.bytes)} now ({machine.describe()})"
    if need <= room:
        return None, f"{found}; the model with every unit cached needs {fmt_bytes(need)}: all resident"
    return room, (
        f"{found}; the model with every unit cached would need {fmt_bytes(need)}: budget {fmt_bytes(room)} (less "
        f"{AUTO_HEADROOM:.0%} and {fmt_bytes(AUTO_RESERVE)} kept for the system and what the plan does not count)"
    )


def budget_bytes(memory_budget, fd) -> int:
    """A budget in bytes: "auto" is budget.auto_budget of what this machine can give now (the model's size where no
    probe answers)."""
    if is_auto(memory_budget):
        return auto_budget(available().bytes or fd.model_bytes)
    return parse_size(memory_budget, fd.model_bytes)


def make_forward(model, engine, kv_bits, backend: str, dtype):
    """The model's pass (engine/forward.py): MLX's forward, with the native CPU step beneath it where that applies
    (backend "auto" or "native"; "native" raises FlashError where it cannot run)."""
    native, why = None, "--backend mlx"
    if backend != "mlx":
        native, why = HostDecoder.of(model, engine) if kv_bits is None else (None, "a quantised KV cache (--kv-bits)")
        if native is None and backend == "native":
            raise FlashError(f"--backend native: the native CPU step does not run: {why}")
    if dtype is None:  # the stored float type
        dtype = next(v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating))
    mlx = MLXForward(model, dtype, why)
    engine.forward = mlx if native is None else Auto(native, mlx)
    plan = getattr(engine, "plan", None)
    fitted = plan and plan.for_forward(engine.fd, native is not None)
    if fitted is not plan:
        # (planned for the other forward, loader.native_expected: no unit is cached yet, the caches are made anew)
        engine.plan = fitted
        engine.resize(engine.plan.capacity)
        if engine.plan.budget is not None:
            mx.set_cache_limit(engine.plan.mlx_cache_limit())
    return engine.forward


def native_expected(fd, backend: Optional[str] = None, kv_bits: int = None) -> bool:
    """Whether `make_forward` will give the native step, as far as the architecture and the stored quantisation of
    the attention and the head tell before the model is built: what the plan is made for (Plan.for_forward corrects
    it after)."""
    if backend_name(backend) == "mlx" or kv_bits is not None or not cpu_gemv.available():
        return False
    model = instantiate(fd.config)
    if HostDecoder.unsupported(model) is not None:
        return False
    head = "model.embed_tokens" if getattr(model.args, "tie_word_embeddings", False) else "lm_head"
    attention = [f"model.layers.{i}.self_attn.{p}" for i in range(len(model.model.layers)) for p in PROJECTIONS]
    return all(_native_rows(fd, path) for path in [head, *attention])


def _native_rows(fd, path: str) -> bool:
    """Whether the native kernels read resident matrix `path` as stored: GGML blocks, or 2/4/8-bit affine codes."""
    if path in fd.blocks:
        return True
    q = fd.config.get("quantization") or {}
    q = q.get(path, q)  # (a module's own, else the default; False: float)
    return isinstance(q, dict) and q.get("mode", "affine") == "affine" and q.get("bits") in (2, 4, 8)


def _streaming(fd, plan, engine, direct: bool, cast) -> Dict[str, Callable[[nn.Module], nn.Module]]:
    """The wrappers of what the plan streams below the resident floor (engine/resident.py), read through a streamer
    whose reads count in the engine's stats; {} when everything resident fits."""
    if not plan.streamed:
        return {}
    engine.use_streamer(
        ResidentStreamer(
            fd, open_reader(fd.path / RESIDENT, direct=direct, threads=STREAM_THREADS), plan.streamed, cast
        )
    )
    return {g.path: partial(wrapper_for(g), streamer=engine.streamer) for g in plan.streamed}


def _load_draft(path, fd: FlashDir, context: int):
    """(a draft model for speculative decoding, resident; the bytes its plan holds): a flash directory with
    `fd`'s vocabulary, every unit cached."""
    draft_fd = FlashDir(path)
    if draft_fd.config.get("vocab_size") != fd.config.get("vocab_size"):
        raise FlashError(
            f"draft model {path}: vocabulary of {draft_fd.config.get('vocab_size')} tokens, the model's "
            f"is {fd.config.get('vocab_size')} (a draft needs the same tokenizer)"
        )
    model, _ = load(path, memory_budget=None, context=context)
    engine = model.flash
    # (and its head's: a resident model's workspace is a layer's rows)
    return model, engine.plan.nbytes(engine.fd.strides) + scale_copy_bytes(draft_fd)


def _load_moe(
    fd,
    tokenizer,
    baseline,
    plan,
    context,
    dtype,
    policy,
    window,
    threads,
    direct,
    kv_bits,
    kv_group_size,
    read_ahead: bool = False,
    half: bool = False,
    backend: str = "auto",
):
    """`load` of a mixture-of-experts directory with its plan: the router picks the experts (exact), so there is no
    sparsity to choose; the plan gives each layer the same number of expert slots. The read-ahead reads into those
    slots."""
    cast = cpu_cast if dtype == mx.float32 else None
    budget = plan.budget
    top_k = min(int(fd.experts_per_token or 0), fd.ffn["n_experts"])  # (a config may ask for more than exist)
    read_ahead = read_ahead and top_k > 0
    reader = fd.open_units(direct=direct, threads=threads or ffn_reader_threads(fd), bounce_bytes=FFN_BOUNCE_BYTES)
    engine = ExpertEngine.from_plan(fd, plan, reader, policy, window, dtype or mx.float32)
    engine.stats.baseline_rss = baseline
    if budget is not None:  # (as the dense `load`'s)
        mx.set_cache_limit(plan.mlx_cache_limit())
    model = build_moe_model(fd, engine, dtype, {**_streaming(fd, plan, engine, direct, cast), **absent_modules(fd)})
    model.flash = engine
    engine.context = context  # where generation stops: the KV cache holds no more
    routers = next_routers(model, {int(i): p for i, p in fd.ffn["switch_paths"].items()}) if read_ahead else {}
    if plan.prefetch_rows:  # a dense FFN's blocks, every one each token's: the next layer's overflow read ahead
        engine.read_ahead = ReadAhead(engine, REGION, plan.prefetch_rows)
    elif routers:
        engine.read_ahead_with(routers, top_k)
    model.forward = make_forward(model, engine, kv_bits, backend, dtype)
    model.make_cache = partial(
        make_cache, model, kv_tokens(context) if budget is not None else None, kv_bits, kv_group_size, half
    )
    return model


def half_kv(config: dict, dtype, kv_bits: int = None, exact: bool = False) -> bool:
    """Keys and values kept in float16 rather than the CPU path's float32: half the KV memory (the batch and context
    the budget holds double), unless `exact` (float results: the native step's float activations, mlx-lm's
    arithmetic) or quantised (kv_bits), and only where every cache is mlx-lm's plain KVCache, so that the plan is
    right."""
    if dtype != mx.float32 or kv_bits is not None or exact:
        return False
    try:
        model_class, args_class = get_model_classes(config)
    except ValueError:  # (an architecture mlx-lm lacks: building the model says so)
        return False
    if not hasattr(model_class, "make_cache"):
        return True  # mlx-lm's KVCache per layer
    caches = model_class(args_class.from_dict(config)).make_cache()  # (its parameters lazy: nothing computed)
    return all(type(c) is KVCache for c in caches)


def kv_itemsize(dtype, half: bool) -> int:
    """Bytes of a key's element: float16 if `half_kv`, else the activations' (dtype None: the model's, 16-bit)."""
    return 2 if half or dtype is None else dtype.size


def exact_by_default() -> bool:
    """Whether `load` keeps float32 keys and values without being asked (`exact`): the native step's activations are
    float (cpu_gemv.set_int8_activations(False), MLX_FLASH_INT8=0)."""
    return cpu_gemv.available() and not cpu_gemv.int8_activations()


def kv_size_of(fd, dtype=mx.float32, kv_bits: int = None, exact: bool = False) -> int:
    """`kv_itemsize` as `load` plans it for flash directory fd (the budget's dtype_size)."""
    return kv_itemsize(dtype, half_kv(fd.config, dtype, kv_bits, exact or exact_by_default()))


def make_cache(model, tokens: int = None, kv_bits: int = None, kv_group_size: int = 64, half: bool = False):
    """The model's own caches, each KVCache allocated for `tokens` (if given) at its first update (mlx-lm grows
    them in 256-token steps, which can overshoot the planned size when a stored cache resumes at
    an offset that is not a whole step), quantised from the start with `kv_bits` (mlx-lm's
    generate quantises only after `quantized_kv_start` tokens), or in float16 (`half_kv`); batches of them are
    per-sequence (forward.Batchable)."""
    caches = type(model).make_cache(model) if hasattr(type(model), "make_cache") else [KVCache() for _ in model.layers]
    if kv_bits is not None and any(type(c) is not KVCache for c in caches):
        raise FlashError(f"kv_bits: {type(model).__module__} uses {type(caches[0]).__name__}, not only plain KV caches")
    # its native passes write host buffers (the loader's forward: a pipeline's rank 0 puts its stage in front)
    host = isinstance(getattr(getattr(model, "flash", None), "forward", None), Auto)
    for i, c in enumerate(caches):
        if type(c) is KVCache:
            if kv_bits is not None:
                c = QuantizedKVCache(kv_group_size, kv_bits)
            elif host:
                c = HostKVCache(dtype=np.float16 if half else np.float32)
            else:
                c = HalfKVCache() if half else FloatKVCache()
            caches[i] = c
            c.step = tokens or c.step
    return caches
