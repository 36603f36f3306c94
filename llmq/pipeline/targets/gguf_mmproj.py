"""A vision-language model's tower and projector as llama.cpp's `mmproj` GGUF (architecture `clip`), the file
`llama-mtmd-cli` / `llama-server --mmproj` load beside the language model's GGUF.

Gemma 3: the SigLIP tower and its projector (`clip.projector_type` gemma3), the hyperparameters from config.json and
the processor's normalisation from its config, tensors under gguf-py's MMPROJ names (the layout of the releases:
`vision_tower.vision_model.*`), as llama.cpp's converter types them: matrices F16, the patch and position embeddings,
norms and biases F32, the projector's norm stored as llama.cpp applies it (1 + w). The tower is never quantized
(models.vision), so the file holds the checkpoint's values at those types.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np

from ...errors import LlmqError
from ...models.checkpoint import read_config
from ...models.reader import CheckpointReader
from ...models.vision import PROCESSOR_FILES, tower_name

GEMMA3_POOL = 4   # the patch grid's pooling llama.cpp assumes for gemma3 unless the file says another


def _processor(path: Path) -> dict:
    """The image processor's settings (preprocessor_config.json, or processor_config.json's image_processor)."""
    for name in PROCESSOR_FILES:
        f = path / name
        if f.is_file():
            cfg = json.loads(f.read_text())
            return cfg.get("image_processor", cfg)
    raise LlmqError(f"{path}: no processor config ({' or '.join(PROCESSOR_FILES)}) to read the image "
                    "normalisation from")


def _gguf_type(hf_name: str, ndim: int) -> gguf.GGMLQuantizationType:
    if ndim >= 2 and ".embeddings." not in hf_name:
        return gguf.GGMLQuantizationType.F16
    return gguf.GGMLQuantizationType.F32


def write_mmproj(src: CheckpointReader, out: Path, name: str) -> dict:
    """Write `mmproj-<name>.gguf` under `out`; returns what the engine's record says of it."""
    config = read_config(src.path)
    if config.get("model_type") != "gemma3":
        raise LlmqError(f"--target gguf: llmq writes the mmproj GGUF of Gemma 3's tower only, not "
                        f"{config.get('model_type')!r}'s")
    vc, proc = config["vision_config"], _processor(src.path)
    side = int(vc["image_size"]) // int(vc["patch_size"])
    tokens_side = int(round(int(config.get("mm_tokens_per_image", 256)) ** 0.5))
    w = gguf.GGUFWriter(None, "clip", use_temp_file=True)
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_name(name)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_clip_has_vision_encoder(True)
    w.add_vision_projection_dim(int(config["text_config"]["hidden_size"]))
    w.add_vision_image_size(int(vc["image_size"]))
    w.add_vision_patch_size(int(vc["patch_size"]))
    w.add_vision_embedding_length(int(vc["hidden_size"]))
    w.add_vision_feed_forward_length(int(vc["intermediate_size"]))
    w.add_vision_block_count(int(vc["num_hidden_layers"]))
    w.add_vision_head_count(int(vc["num_attention_heads"]))
    w.add_vision_image_mean([float(x) for x in proc["image_mean"]])
    w.add_vision_image_std([float(x) for x in proc["image_std"]])
    w.add_clip_projector_type(gguf.VisionProjectorType.GEMMA3)
    w.add_vision_attention_layernorm_eps(float(vc.get("layer_norm_eps", 1e-6)))
    w.add_vision_use_gelu(True)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if side // tokens_side != GEMMA3_POOL:
        w.add_vision_projector_scale_factor(side // tokens_side)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, int(vc["num_hidden_layers"]))
    types: dict[str, int] = {}
    for stored in sorted(src.tensors.vision):
        hf = tower_name(stored).replace("vision_tower.", "vision_tower.vision_model.", 1)
        if hf.startswith("vision_tower.vision_model.head."):   # SigLIP's pooling head: Gemma 3 does not use it
            continue
        hf = hf.replace("_weight", ".weight")   # mm_input_projection_weight: a bare parameter
        new = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise LlmqError(f"--target gguf: no llama.cpp mmproj name for tower tensor {stored}")
        t = src.tensors.vision_tensor(stored).float()
        if "soft_emb_norm" in hf:
            t = t + 1.0   # Gemma's RMSNorm scales by (1 + w); llama.cpp's clip multiplies by the weight
        qtype = _gguf_type(hf, t.dim())
        w.add_tensor(new, t.numpy().astype(np.float16 if qtype == gguf.GGMLQuantizationType.F16 else np.float32),
                     raw_dtype=qtype)
        types[qtype.name] = types.get(qtype.name, 0) + 1
    fname = f"mmproj-{name}.gguf"
    w.write_header_to_file(out / fname)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"file": fname, "architecture": "clip", "projector_type": "gemma3",
            "tensor_types": dict(sorted(types.items()))}
