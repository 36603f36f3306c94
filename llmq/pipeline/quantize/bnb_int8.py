"""bitsandbytes LLM.int8: int8 rows with their absmax (SCB; w = q * SCB / 127), quantized by bitsandbytes itself
from the float16 weights, as `load_in_8bit=True` does; at run time activation columns holding an outlier (|x| >=
`--int8-threshold`, default 6.0) are computed in floating point and the rest in int8 (the runtime's LLMInt8Linear).
The artifact is a bitsandbytes checkpoint (`llmq.models.bnbformat`).
"""

from __future__ import annotations

import torch

from ...errors import LlmqError
from ...models import bnbformat
from .bnb_nf4 import refuse_fused

BITS = (8,)
CALIBRATED = False


def validate(opts, spec) -> None:
    refuse_fused(opts, spec)
    if opts.group_size or opts.per_tensor or not opts.symmetric:
        raise LlmqError("bnb-int8 has one symmetric scale per output row; drop --group-size / --per-tensor / --asym")


def quantize_layer(ctx) -> dict[str, bnbformat.Int8Weight]:
    bnb = bnbformat.bitsandbytes()
    out = {}
    for name, lin in ctx.linears.items():
        q, scb, _ = bnb.functional.int8_vectorwise_quant(lin.weight.data.to(torch.float16).contiguous())
        out[name] = bnbformat.Int8Weight(q.cpu(), scb.float().cpu(), ctx.opts.int8_threshold)
    return out
