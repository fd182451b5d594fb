"""The parts of mlx-lm that mlx_flash builds on although they are not its public API: private functions it
calls, methods its server overrides, a module attribute it swaps. setup.py bounds mlx-lm below the next minor
release; this fails loudly, naming the part, when an mlx-lm inside that bound changes one of them."""

import importlib
import inspect

import pytest

# (module, attribute path, the parameters mlx_flash relies on, in order)
RELIED_ON = [
    ("mlx_lm.utils", "_get_classes", ["config"]),  # models.get_model_classes defers to it
    # models.hunyuan_moe subclasses them (its MoE block's __call__ renormalises, on the same attributes)
    ("mlx_lm.models.hunyuan", "MoeBlock.__init__", ["self", "args", "layer_idx"]),
    ("mlx_lm.models.hunyuan", "Model.__init__", ["self", "args"]),
    ("mlx_lm.generate", "maybe_quantize_kv_cache", ["prompt_cache", "quantized_kv_start", "kv_group_size", "kv_bits"]),
    ("mlx_lm.generate", "generation_stream", None),  # generation.generate_step computes on it
    ("mlx_lm.server", "stream_generate", ["model", "tokenizer", "prompt", "max_tokens"]),  # swapped per request
    ("mlx_lm.server", "ModelProvider.__init__", ["self", "cli_args"]),
    ("mlx_lm.server", "ModelProvider._load", ["self", "model_path", "adapter_path", "draft_model_path"]),
    ("mlx_lm.server", "ModelProvider.load_default", ["self"]),
    ("mlx_lm.server", "ResponseGenerator._tokenize", ["self", "tokenizer", "request", "args"]),
    ("mlx_lm.server", "ResponseGenerator._serve_single", ["self", "request", "stream"]),
    # server.ResponseGenerator: its generation loop restarted after a failed pass, its admission and batching
    ("mlx_lm.server", "ResponseGenerator._run_generate", ["self"]),
    ("mlx_lm.server", "ResponseGenerator._generate", ["self"]),
    ("mlx_lm.server", "ResponseGenerator._next_request", ["self", "timeout"]),
    ("mlx_lm.server", "ResponseGenerator._is_batchable", ["self", "args"]),
    ("mlx_lm.server", "APIHandler.handle_models_request", ["self"]),
    ("mlx_lm.server", "APIHandler.handle_text_completions", ["self"]),
    ("mlx_lm.server", "APIHandler.handle_completion", ["self", "request", "stop_words"]),
]


@pytest.mark.parametrize("module,path,params", RELIED_ON, ids=[f"{m}.{p}" for m, p, _ in RELIED_ON])
def test_mlx_lm_still_has_what_mlx_flash_relies_on(module, path, params):
    obj = importlib.import_module(module)  # (not attribute access: mlx_lm.generate is also a function)
    for name in path.split("."):
        assert hasattr(obj, name), f"mlx-lm {module}.{path}: gone (mlx_flash relies on it; see setup.py's bound)"
        obj = getattr(obj, name)
    if params is not None:
        have = list(inspect.signature(obj).parameters)
        assert have[: len(params)] == params, (
            f"mlx-lm {module}.{path}{inspect.signature(obj)} changed: mlx_flash calls it as ({', '.join(params)})"
        )


def test_mlx_lm_still_decides_distribution_by_its_flag():
    """server.ResponseGenerator answers `_is_distributed` False (a pipeline's rank 0 serves alone): mlx-lm must still
    set and read that attribute, or its generator would share requests with the other ranks."""
    from mlx_lm import server

    source = inspect.getsource(server.ResponseGenerator)
    assert "self._is_distributed =" in source and "if not self._is_distributed" in source, (
        "mlx-lm's ResponseGenerator no longer decides by self._is_distributed: mlx_flash.server overrides it"
    )
