"""What the GGUF export of a model will weigh, known before it is quantized: `llmq quantize --max-size S --size-in
gguf` prices mixed precision in the bytes of the file `llmq build --target gguf` writes, so that file is at most S.

The layout is the writer's own: its metadata (hyperparameters, tokenizer, file type) and tensor table are written by
the writer's functions to a scratch file and measured, and every tensor is laid out by `add_weights` into a recorder
that keeps sizes, not data. Tensors outside the decoder linears count as the writer stores them (norms and biases
F32, 16-bit weights in their dtype, an INT8 embedding or head as Q8_0), each padded to the file's alignment; the
decoder linears are what the mixed-precision choice prices (`linear_bytes`), their padding counted here at its most.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import gguf
from gguf import MODEL_TENSOR as MT

from ...models.reader import CheckpointReader
from .gguf_meta import add_hparams, add_tokenizer
from .gguf_tensors import Tensors, add_weights

BLOCK = 32
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}   # GGML's 32-weight blocks: fp16 d (m)
NAME_BYTES = 255   # general.name holds the quantized artifact's name, not known yet: priced at its longest
TABLES = tuple(f"{gguf.TENSOR_NAMES[t]}.weight" for t in (MT.TOKEN_EMBD, MT.OUTPUT))   # llama.cpp's own names
# matrices in a layer that the choice does not price (kept as stored): the routers ("ffn_gate_inp", also in the
# shared expert's gate's name), a Gated DeltaNet's rate projections and convolution
KEPT = tuple(gguf.TENSOR_NAMES[t].split(".")[-1] for t in (MT.FFN_GATE_INP, MT.SSM_BETA, MT.SSM_ALPHA, MT.SSM_CONV1D))


def linear_bytes(n: int, k: int, bits: int, symmetric: bool) -> int:
    """Bytes of a [n, k] decoder linear in the GGUF at `bits`: Q4_0 / Q5_0 (Q4_1 / Q5_1 with zero points), Q8_0, or
    16-bit."""
    if bits == 16:
        return 2 * n * k
    kind = "Q8_0" if bits == 8 else f"Q{bits}_{0 if symmetric else 1}"
    return n * (k // BLOCK) * BLOCK_BYTES[kind]


class _Recorder:
    """Stands in for the GGUFWriter under `add_weights`: each tensor's name, shape, dtype and bytes, no data."""

    def __init__(self):
        self.tensors: list[tuple] = []

    def add_tensor(self, name: str, arr, raw_dtype=None) -> None:
        self.tensors.append((name, arr.shape, arr.dtype, arr.nbytes, raw_dtype))


def fixed_bytes(model_dir: Path | str, embedding_int8: bool, lm_head_int8: bool, untied: bool = False) -> int:
    """Bytes of the GGUF of the (16-bit) model at `model_dir` outside its decoder linears' data: metadata, tensor
    table, every other tensor as the writer stores it, and all padding (the linears' at its most). `untied`: a tied
    head will be a tensor of its own (--rotate), as --lm-head int8 makes it."""
    src = CheckpointReader(model_dir)
    rec = _Recorder()
    add_weights(Tensors(rec, src.arch), src)
    w = gguf.GGUFWriter(None, src.arch.gguf_arch)
    add_hparams(w, src, "x" * NAME_BYTES)
    add_tokenizer(w, src)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for name, shape, dtype, nbytes, raw in rec.tensors:
        w.add_tensor_info(name, shape, dtype, nbytes, raw_dtype=raw)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "layout.gguf"
        w.write_header_to_file(path)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        w.close()
        size = gguf.GGUFWriter.ggml_pad(path.stat().st_size, w.data_alignment)
    align = w.data_alignment
    for name, shape, _, nbytes, _ in rec.tensors:
        if len(shape) >= 2 and name not in TABLES and not any(k in name for k in KEPT):   # priced by the choice
            size += align - 1
            continue
        int8 = (name == TABLES[0] and embedding_int8) or (name == TABLES[1] and lm_head_int8)
        size += gguf.GGUFWriter.ggml_pad(shape[0] * (shape[1] // BLOCK) * BLOCK_BYTES["Q8_0"] if int8 else nbytes,
                                         align)
    if (lm_head_int8 or untied) and not any(t[0] == TABLES[1] for t in rec.tensors):   # tied, then untied
        (rows, cols), table = rec.tensors[0][1], rec.tensors[0][3]
        size += gguf.GGUFWriter.ggml_pad(rows * (cols // BLOCK) * BLOCK_BYTES["Q8_0"] if lm_head_int8 else table,
                                         align) + 256   # and a tensor-table entry
    return size
