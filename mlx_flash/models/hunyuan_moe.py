"""Hunyuan-A13B's mixture of experts routed as its reference routes it: mlx-lm's hunyuan with the top-k weights
renormalised.

Tencent's modeling code (hunyuan_topkgating: the softmax's top k divided by their sum), vLLM and SGLang
(renormalize=top_k > 1) and llama.cpp's "hunyuan-moe" (norm_topk_prob) renormalise the weights of the experts a
token is routed to; mlx-lm's hunyuan (written for Hunyuan-Large) weights them by the softmax as it is and has no
setting for it. GGUFs of llama.cpp's "hunyuan-moe" convert to this model type; mlx-lm, which has no class of this
name, refuses the directory rather than run it with other routing.
"""

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models import hunyuan


@dataclass
class ModelArgs(hunyuan.ModelArgs):
    pass


class MoeBlock(hunyuan.MoeBlock):
    def __call__(self, x: mx.array) -> mx.array:
        gates = mx.softmax(self.gate(x), axis=-1, precise=True)
        k = self.top_k
        inds = mx.stop_gradient(mx.argpartition(-gates, kth=k - 1, axis=-1)[..., :k])
        scores = mx.take_along_axis(gates, inds, axis=-1)
        scores = scores / scores.sum(axis=-1, keepdims=True)  # (the one difference from mlx-lm's)
        y = self.switch_mlp(x, inds)
        y = (y * scores[..., None].astype(mx.float32)).sum(axis=-2).astype(y.dtype)
        if self.use_shared_mlp:
            y = y + self.shared_mlp(x)
        return y


class Model(hunyuan.Model):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        for i, layer in enumerate(self.model.layers):
            if isinstance(layer.mlp, hunyuan.MoeBlock):
                layer.mlp = MoeBlock(args, i)
