"""The vision side of a vision-language model in llmq's runtime: Gemma 3's SigLIP tower and multimodal projector,
plain torch over the checkpoint's tensors (kept as stored: never quantized, models.vision).

SigLIP: the image's patches (a strided convolution) plus a learned position embedding, then pre-norm encoder layers
(LayerNorm, bidirectional multi-head attention with biases, LayerNorm, a tanh-gelu MLP), then a final LayerNorm.
Gemma 3's projector average-pools the patch grid to mm_tokens_per_image tokens, RMS-normalizes each with a (1 + w)
scale and projects it to the language model's width. Written here rather than borrowed from transformers so the
runtime owns what it computes (dtype, device, and later a quantized tower) the way it owns the decoder; the tests
hold it to transformers' modules.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import LlmqError


class _Layer(nn.Module):
    def __init__(self, t: dict[str, torch.Tensor], heads: int, eps: float):
        super().__init__()
        self.t, self.heads, self.eps = t, heads, eps

    def _ln(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.t[f"{name}.weight"], self.t[f"{name}.bias"], self.eps)

    def _lin(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.t[f"{name}.weight"], self.t[f"{name}.bias"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, s, d = x.shape
        y = self._ln(x, "layer_norm1")
        q, k, v = (self._lin(y, f"self_attn.{p}_proj").view(n, s, self.heads, -1).transpose(1, 2) for p in "qkv")
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, s, d)
        x = x + self._lin(a, "self_attn.out_proj")
        y = F.gelu(self._lin(self._ln(x, "layer_norm2"), "mlp.fc1"), approximate="tanh")
        return x + self._lin(y, "mlp.fc2")


class Gemma3Vision(nn.Module):
    """pixel values [n, 3, H, W] (the processor's) -> image embeddings [n, mm_tokens_per_image, text hidden]."""

    def __init__(self, tensors: dict[str, torch.Tensor], config: dict):
        super().__init__()
        vc = config["vision_config"]
        if vc.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise LlmqError(f"vision_config hidden_act={vc['hidden_act']!r} is not supported: llmq's SigLIP tower "
                            "computes the tanh-approximated gelu")
        self.t = tensors
        self.patch = int(vc["patch_size"])
        self.side = int(vc["image_size"]) // self.patch
        self.eps = float(vc.get("layer_norm_eps", 1e-6))
        self.layers = [_Layer(_under(tensors, f"vision_tower.encoder.layers.{i}."), int(vc["num_attention_heads"]),
                              self.eps) for i in range(int(vc["num_hidden_layers"]))]
        tokens_side = int(round(int(config.get("mm_tokens_per_image", 256)) ** 0.5))
        if tokens_side ** 2 != int(config.get("mm_tokens_per_image", 256)) or self.side % tokens_side:
            raise LlmqError("mm_tokens_per_image must be a square whose side divides the tower's patch grid")
        self.pool = self.side // tokens_side
        self.tokens_per_image = tokens_side ** 2
        self.image_token = int(config.get("image_token_id", config.get("image_token_index")))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        t = self.t
        w = t["vision_tower.embeddings.patch_embedding.weight"]
        x = F.conv2d(pixels.to(w.dtype), w, t["vision_tower.embeddings.patch_embedding.bias"], stride=self.patch)
        x = x.flatten(2).transpose(1, 2) + t["vision_tower.embeddings.position_embedding.weight"]
        for layer in self.layers:
            x = layer(x)
        x = F.layer_norm(x, x.shape[-1:], t["vision_tower.post_layernorm.weight"],
                         t["vision_tower.post_layernorm.bias"], self.eps)
        n, _, d = x.shape
        x = F.avg_pool2d(x.transpose(1, 2).reshape(n, d, self.side, self.side), self.pool).flatten(2).transpose(1, 2)
        xf = x.float()   # Gemma's RMSNorm: in float32, times (1 + w), back to the compute dtype
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        x = (xf * (1.0 + t["multi_modal_projector.mm_soft_emb_norm.weight"].float())).to(x.dtype)
        return x @ t["multi_modal_projector.mm_input_projection_weight"]


def _under(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


def load_vision(tensors, config: dict, dtype: torch.dtype, device: torch.device) -> Gemma3Vision:
    """The tower and projector of a vision-language checkpoint (models.reader.LazyTensors' `vision`), in the compute
    dtype on `device`."""
    from ...models.vision import family, tower_name

    family(config)
    return Gemma3Vision({tower_name(n): tensors.vision_tensor(n).to(device=device, dtype=dtype)
                         for n in tensors.vision}, config)
