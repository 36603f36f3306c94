"""bitsandbytes NF4: 4-bit NormalFloat codes (QLoRA's data type: the quantiles of a normal distribution) with one
absmax per block of `--group-size` weights (default 64) of the flattened weight, and optionally the absmax values
quantized too (`--double-quant`). bitsandbytes itself quantizes, with the call transformers makes for
`load_in_4bit=True`, on the float32 values of the stored weights (so the state records float32 and the weight is
exactly code x absmax); the artifact is a bitsandbytes checkpoint (`llmq.models.bnbformat`).
"""

from __future__ import annotations

import torch

from ...errors import LlmqError
from ...models import bnbformat

BITS = (4,)
CALIBRATED = False
GROUP_SIZE = 64  # the default block: bitsandbytes' and transformers' for 4 bits


def refuse_fused(opts, spec) -> None:
    """Every reader cuts a fused group (Phi-3's qkv_proj) into its roles by rows; a bitsandbytes packing it cannot."""
    if spec.arch.fused:
        raise LlmqError(f"--method {opts.method}: {spec.architecture} stores {', '.join(spec.arch.fused)} fused and "
                        "llmq does not cut bitsandbytes packings into their roles; use rtn, gptq, awq, smoothquant or "
                        "fp8")


def validate(opts, spec) -> None:
    refuse_fused(opts, spec)
    if opts.group_size not in bnbformat.BLOCKSIZES:
        raise LlmqError(f"bnb-nf4 quantizes blocks of {', '.join(map(str, bnbformat.BLOCKSIZES))} weights; "
                        f"--group-size {opts.group_size or 'per channel'} is not one")
    if not opts.symmetric or opts.per_tensor:
        raise LlmqError("bnb-nf4 has one absmax per block (symmetric); drop --asym / --per-tensor")


def quantize_layer(ctx) -> dict[str, bnbformat.NF4Weight]:
    bnb = bnbformat.bitsandbytes()
    out = {}
    for name, lin in ctx.linears.items():
        packed, state = bnb.functional.quantize_4bit(lin.weight.data.float().contiguous(),
                                                     blocksize=ctx.opts.group_size,
                                                     compress_statistics=ctx.opts.double_quant, quant_type="nf4",
                                                     quant_storage=torch.uint8)
        out[name] = bnbformat.NF4Weight({"weight": packed.cpu()} | {
            f"weight.{k}": v.cpu() for k, v in state.as_dict(packed=True).items()})
    return out
