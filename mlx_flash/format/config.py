"""A model's shape as its config gives it (layers, hidden size, attention heads), under whichever names it uses."""

# the names configs give the attention's sizes (Hugging Face's; mlx-lm's model args, e.g. phixtral's; GPT-2 style)
LAYERS = ("num_hidden_layers", "num_layers", "n_layer")
HIDDEN = ("hidden_size", "model_dim", "n_embd")
HEADS = ("num_attention_heads", "num_heads", "n_head")
# a config key of mlx_flash's own: the neurons of a unit where a dense FFN is blocks of neurons (models/blocked.py)
UNITS = "mlx_flash_ffn_units"


def first_of(config: dict, keys: tuple):
    """The first of `keys` a config has, a multimodal wrapper's language model's (text_config) if it has one;
    None if it has none of them."""
    config = config.get("text_config", config)
    return next((config[k] for k in keys if config.get(k)), None)


def layer_count(config: dict):
    """The layers mlx-lm builds for a config: its model arguments' count where mlx-lm has the model (a config may
    give several: LongCat-Flash's num_hidden_layers counts sublayers, mlx-lm builds num_layers), else the first of
    LAYERS the config gives (None: none)."""
    import importlib

    from mlx_lm.utils import MODEL_REMAPPING

    model_type = config.get("model_type")
    try:
        module = importlib.import_module(f"mlx_lm.models.{MODEL_REMAPPING.get(model_type, model_type)}")
        args = module.ModelArgs.from_dict(config)
    except Exception:  # (not an mlx-lm model, e.g. opt, or a config its arguments refuse)
        return first_of(config, LAYERS)
    return next((getattr(args, k) for k in LAYERS if isinstance(getattr(args, k, None), int)), None) or first_of(
        config, LAYERS
    )


def attention_shape(config: dict) -> tuple:
    """(layers, hidden size, attention heads) of a config; KeyError naming what it lacks."""
    shape = tuple(first_of(config, keys) for keys in (LAYERS, HIDDEN, HEADS))
    if None in shape:
        raise KeyError(f"the config gives none of {', '.join((LAYERS, HIDDEN, HEADS)[shape.index(None)])}")
    return shape


def head_dim(config: dict) -> int:
    _, hidden, heads = attention_shape(config)
    return first_of(config, ("head_dim",)) or hidden // heads
