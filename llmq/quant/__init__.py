"""Quantization arithmetic, once: the grids, casts, scale rules and packings that `llmq quantize`, `llmq quantize-kv`,
the exports and the runtime all compute with, so a quality probe measures what serve computes. One module per family
of formats (int_fp8: the integer grid, the FP8 cast, absmax scales; fp8_block; fp4: NVFP4 / MXFP4; kquant: GGML's Q4_K;
iquant: GGML's IQ4_XS / IQ4_NL; ggml: llama.cpp's CPU activation rounding; bnb: bitsandbytes'), each stating its
conventions; their public names are this package's, so callers write `quant.round_int`. A leaf: imports nothing of
llmq, so models, pipeline and runtime can all use it.
"""

from __future__ import annotations

from .bnb import (  # noqa: F401
    INV_127,
    INV_127_SQ,
    dequantize_4bit,
    dequantize_blockwise,
    llm_int8_activations,
    llm_int8_dequantize,
)
from .fp4 import (  # noqa: F401
    E2M1,
    E2M1_MAX,
    E8M0_BIAS,
    FP4_SIGN,
    MXFP4_BLOCK,
    NVFP4_BLOCK,
    NVFP4_GLOBAL,
    SIXTH,
    dequantize_fp4,
    e2m1_codes,
    e2m1_values,
    fp4_activation_codes,
    fp4_activations,
    fp4_block_scale,
    mxfp4_activation_scales,
    mxfp4_quantize,
    nvfp4_activation_scales,
    nvfp4_global_scale,
    nvfp4_quantize,
    pack_fp4,
    round_e4m3,
    unpack_fp4,
)
from .fp8_block import (  # noqa: F401
    FP8_BLOCK,
    dequantize_fp8_blocks,
    fp8_block_quantize,
    quantize_token_groups,
)
from .ggml import VEC_DOT_TYPE, ggml_activations  # noqa: F401
from .int_fp8 import (  # noqa: F401
    EPS,
    FP8,
    FP8_MAX,
    INT8_MAX,
    absmax_scale,
    decode_kv,
    dequantize,
    encode_kv,
    int_range,
    pack_int4_rows,
    quantize_blocks,
    quantize_tokens,
    round_int,
    to_fp8,
    unpack_int4_rows,
)
from .iquant import (  # noqa: F401
    IQ4_BLOCK,
    IQ4_VALUES,
    IQ4NL_BYTES,
    IQ4XS_BYTES,
    IQ4XS_SUPER,
    dequantize_iq4,
    iq4_codes,
    iq4_nearest,
    iq4_nl_grid,
    iq4_xs_grid,
    iq4_xs_steps,
    pack_iq4_nl,
    pack_iq4_xs,
    unpack_iq4_nl,
    unpack_iq4_xs,
)
from .kquant import (  # noqa: F401
    Q4K_BYTES,
    Q4K_STEPS,
    Q4K_SUB,
    Q4K_SUPER,
    dequantize_q4_k,
    pack_q4_k,
    q4_k_codes,
    q4_k_grid,
    q4_k_scale_min,
    unpack_q4_k,
)
