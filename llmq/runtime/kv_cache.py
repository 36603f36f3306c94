"""The paged KV cache: one [num_blocks, block_size, kv_heads, head_dim] tensor per layer for K and for V.

Stored in the compute dtype ("auto"), or quantized per tensor (or per head) with the calibrated k_scale / v_scale
of `llmq quantize-kv` (fp8 without calibration uses scale 1.0) by `llmq.quant.encode_kv`: int8 (round(x / scale) on
[-128, 127]) or fp8 e4m3 (x / scale saturated to +-448), the arithmetic quantize-kv measures its error with. FP8 is
kept as raw bytes because CPU indexing kernels do not handle float8 tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .. import quant
from ..errors import LlmqError
from .config import KV_DTYPES


def kv_element_bytes(kv_dtype: str, compute_dtype: torch.dtype) -> int:
    return compute_dtype.itemsize if kv_dtype == "auto" else 1


class LayerKV:
    """One layer's K and V blocks plus their quantization scales (None when stored unquantized)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, kv_dtype: str, k_scale: torch.Tensor | None,
                 v_scale: torch.Tensor | None, compute_dtype: torch.dtype):
        self.k, self.v = k, v
        self.kv_dtype = kv_dtype
        self.k_scale, self.v_scale = k_scale, v_scale
        self.compute_dtype = compute_dtype
        self.observer: Callable[[torch.Tensor, torch.Tensor], None] | None = None  # ModelRunner.observe_kv

    def _encode(self, x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        if self.kv_dtype == "auto":
            return x
        q = quant.encode_kv(x, scale, fp8=self.kv_dtype == "fp8")
        return q.view(torch.uint8) if q.dtype == quant.FP8 else q

    def _decode(self, x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        if self.kv_dtype == "auto":
            return x
        return quant.decode_kv(x.view(quant.FP8) if self.kv_dtype == "fp8" else x, scale, self.compute_dtype)

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new tokens' K/V ([T, Hkv, D]) at flat slot indices (block * block_size + offset)."""
        if self.observer is not None:
            self.observer(k, v)
        nb, bs, h, d = self.k.shape
        self.k.view(nb * bs, h, d).index_copy_(0, slots, self._encode(k, self.k_scale))
        self.v.view(nb * bs, h, d).index_copy_(0, slots, self._encode(v, self.v_scale))

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V stored at flat slot indices, [T, Hkv, D] in compute dtype (what a layer sharing this cache reads of
        the step's own tokens: ModelSpec.kv_source)."""
        nb, bs, h, d = self.k.shape
        return (self._decode(self.k.view(nb * bs, h, d).index_select(0, slots), self.k_scale),
                self._decode(self.v.view(nb * bs, h, d).index_select(0, slots), self.v_scale))

    def gather(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given block tables [B, nblocks] as [B, nblocks * block_size, Hkv, D] in compute dtype."""
        b, n = blocks.shape
        _, bs, h, d = self.k.shape
        flat = blocks.reshape(-1)  # index_select copies whole blocks; ~5x faster than advanced indexing on CPU
        k = self.k.index_select(0, flat).view(b, n * bs, h, d)
        v = self.v.index_select(0, flat).view(b, n * bs, h, d)
        return self._decode(k, self.k_scale), self._decode(v, self.v_scale)


@dataclass
class Journal:
    """A slot's recurrent state when speculation began (AttentionMetadata.journal) and the inputs of every token the
    slot took since: what rolling the state back to any of those tokens needs (GatedDeltaNet replays the kept ones)."""

    conv: torch.Tensor
    state: torch.Tensor
    qkv: list[torch.Tensor] = field(default_factory=list)   # each step's rows [n, channels], before the convolution
    g: list[torch.Tensor] = field(default_factory=list)     # their decays and rates [n, value heads]
    beta: list[torch.Tensor] = field(default_factory=list)

    def __len__(self) -> int:
        return sum(len(t) for t in self.qkv)


class LayerRecurrent:
    """One Gated DeltaNet layer's state of every sequence slot (BlockManager.state_slot): the convolution's last
    kernel - 1 inputs [slots, channels, kernel - 1] in the compute dtype and the delta rule's state [slots, value
    heads, key dim, value dim] in float32. Fixed per sequence; a slot is overwritten, not reset, when a new sequence
    takes it: a prefill from position 0 starts from zeros. `journals`: the slots that speculate (Journal), whose
    states may have to go back past rejected tokens."""

    def __init__(self, slots: int, channels: int, kernel: int, heads: int, key_dim: int, value_dim: int,
                 compute_dtype: torch.dtype, device):
        self.conv = torch.zeros(slots, channels, kernel - 1, dtype=compute_dtype, device=device)
        self.state = torch.zeros(slots, heads, key_dim, value_dim, dtype=torch.float32, device=device)
        self.journals: dict[int, Journal] = {}


def allocate_layer_caches(spec, num_blocks: int, block_size: int, num_kv_heads: int, kv_dtype: str,
                          compute_dtype: torch.dtype, device, scales: list | None, state_slots: int, tp: int = 1
                          ) -> list[LayerKV | LayerRecurrent]:
    """One rank's cache of every layer, by what the layer keeps between steps: the paged KV cache of an attention
    layer (scales: those of the layers keeping one, in order; num_kv_heads: the rank's, or layer by layer the
    model's where its global layers have their own: ModelSpec.kv_heads_of), the same cache object for a layer reading
    an earlier layer's (ModelSpec.kv_source), the per-sequence state of a Gated DeltaNet layer
    (ModelSpec.linear_layers; a rank holds its 1 / tp of the heads)."""
    kv_layers = spec.kv_layers()
    shapes = [(spec.kv_heads_of(i) if spec.global_kv_heads else num_kv_heads, spec.head_dim_of(i)) for i in kv_layers]
    kv = dict(zip(kv_layers, allocate_kv_cache(shapes, num_blocks, block_size, kv_dtype, compute_dtype, device,
                                               scales)))
    return [LayerRecurrent(state_slots, spec.linear_conv_dim // tp, spec.linear_kernel, spec.linear_value_heads // tp,
                           spec.linear_key_dim, spec.linear_value_dim, compute_dtype, device)
            if i in spec.linear_layers else kv[spec.kv_source[i] if spec.kv_source else i]
            for i in range(spec.num_layers)]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A zeroed cache tensor. On CPU it lives in an anonymous mapping: zero pages are committed only when a block is
    first written, so a generous KV budget costs no memory (and no seconds of memset) until it is used. Zeros, not
    garbage, matter: masked-out slots still enter attention as 0 x value, and NaN garbage would poison it."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    import math
    import mmap

    nbytes = math.prod(shape) * dtype.itemsize
    buf = mmap.mmap(-1, max(nbytes, 1))
    return torch.frombuffer(buf, dtype=dtype, count=math.prod(shape)).view(shape)


def _scale_tensor(scale: torch.Tensor | float, num_kv_heads: int, head_dim: int, device) -> torch.Tensor:
    """Per-tensor scale -> scalar; per-head -> [Hkv, 1]; per-channel -> [Hkv, D] (all broadcast over [.., Hkv, D])."""
    s = torch.as_tensor(scale, dtype=torch.float32).flatten().to(device)
    if s.numel() == 1:
        return s.reshape(())
    if s.numel() == num_kv_heads:
        return s.view(num_kv_heads, 1)
    if s.numel() == num_kv_heads * head_dim:
        return s.view(num_kv_heads, head_dim)
    raise LlmqError(f"KV scale has {s.numel()} values; expected 1, one per KV head ({num_kv_heads}) or one per "
                    f"channel ({num_kv_heads * head_dim})")


def allocate_kv_cache(shapes: list[tuple[int, int]], num_blocks: int, block_size: int, kv_dtype: str,
                      compute_dtype: torch.dtype, device,
                      scales: list[tuple[torch.Tensor, torch.Tensor]] | None) -> list[LayerKV]:
    """One LayerKV a layer of `shapes` (its KV heads, head_dim), with its (k_scale, v_scale) where quantized."""
    if kv_dtype not in KV_DTYPES:
        raise LlmqError(f"kv cache dtype must be one of {', '.join(KV_DTYPES)}; got {kv_dtype!r}")
    if kv_dtype == "fp8" and scales is None:  # uncalibrated fp8: unit scales
        scales = [(torch.ones(()), torch.ones(()))] * len(shapes)
    if kv_dtype != "auto" and (scales is None or len(scales) != len(shapes)):
        raise LlmqError(f"a {kv_dtype} KV cache needs calibrated k_scale/v_scale for every layer; "
                        "run `llmq quantize-kv` on this model first")
    storage = {"auto": compute_dtype, "int8": torch.int8, "fp8": torch.uint8}[kv_dtype]
    layers = []
    for i, (num_kv_heads, head_dim) in enumerate(shapes):
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        k = _zeros(shape, storage, device)
        v = _zeros(shape, storage, device)
        ks = vs = None
        if kv_dtype != "auto":
            ks, vs = (_scale_tensor(s, num_kv_heads, head_dim, device) for s in scales[i])
        layers.append(LayerKV(k, v, kv_dtype, ks, vs, compute_dtype))
    return layers
