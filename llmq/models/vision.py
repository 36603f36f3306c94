"""Vision-language checkpoints (`*ForConditionalGeneration`): a language model llmq already runs, beside a vision
tower and a projector that turn an image into embeddings of that language model's width.

The artifact keeps the checkpoint as Hugging Face stores it (config.json with `text_config` and `vision_config`, the
language model's tensors under a prefix, the tower's and projector's beside them), so transformers, vLLM and SGLang
load it as the vision-language model it is. Every llmq stage sees the language model through one view, defined here:
`language_config` (the text config, quantization and dtype carried) and `text_name` (a stored tensor name as the text
model names it; None for the tower's and the projector's). The tower and projector are never quantized: every stage
copies them as stored.
"""

from __future__ import annotations

from ..errors import LlmqError

# config.json's model_type of a supported vision-language family -> its language model's model_type
FAMILIES = {"gemma3": "gemma3_text", "gemma4": "gemma4_text"}
# the families whose towers every stage carries as stored but the runtime does not run yet: their text is served, an
# image refused in one line (why)
TEXT_ONLY = {"gemma4": "llmq carries Gemma 4's vision and audio towers into every artifact but does not run them yet"}
# the families whose transformers class leaves the text model's final_logit_softcapping out (Gemma 3's)
SOFTCAP_IGNORED = ("gemma3",)

# vision-language families llmq recognizes but does not run yet, with why (each refused in one line)
NOT_YET = {
    "qwen3_vl": "Qwen3-VL's multimodal rotary positions (M-RoPE) and windowed vision encoder are not implemented",
    "qwen3_vl_moe": "Qwen3-VL's multimodal rotary positions (M-RoPE) and windowed vision encoder are not implemented",
    "qwen3_5": "Qwen3.5's vision encoder and multimodal rotary positions (M-RoPE) are not implemented; its text "
               "model (qwen3_5_text) is",
    "qwen3_5_moe": "Qwen3.5's vision encoder and multimodal rotary positions (M-RoPE) are not implemented",
    "qwen2_5_vl": "Qwen2.5-VL's multimodal rotary positions (M-RoPE) are not implemented",
    "qwen2_vl": "Qwen2-VL's multimodal rotary positions (M-RoPE) are not implemented",
    "smolvlm": "SmolVLM's (Idefics3) image splitting and pixel-shuffle connector are not implemented",
    "idefics3": "Idefics3's image splitting and pixel-shuffle connector are not implemented",
    "gemma3n": "Gemma 3n's audio / MobileNet towers and per-layer embeddings are not implemented",
}

# where a conditional-generation checkpoint keeps its language model (stored prefix -> the text model's prefix):
# transformers writes the first two (its legacy layout and its module paths), and the last two for the head
LANGUAGE_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                     ("language_model.lm_head.", "lm_head."))
# the tower's and the projector's tensors, as stored
VISION_PREFIXES = tuple(p + t for p in ("", "model.") for t in ("vision_tower.", "multi_modal_projector.",
                                                                  "embed_vision.", "audio_tower.", "embed_audio."))
# the compressed-tensors `ignore` entries that keep them out of every quantization scheme (module paths as
# transformers and vLLM name them, with or without the "model." of transformers 5)
VISION_IGNORE = ("re:.*vision_tower.*", "re:.*multi_modal_projector.*", "re:.*embed_vision.*", "re:.*audio_tower.*",
                 "re:.*embed_audio.*")
# the processor's files: how an image becomes pixel values and how many tokens it takes in the prompt
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def is_multimodal(config: dict) -> bool:
    """Whether config.json describes a vision-language checkpoint (one with a vision_config)."""
    return "vision_config" in config or any(str(a).endswith("ForConditionalGeneration")
                                            for a in config.get("architectures") or ())


def family(config: dict) -> str:
    """The supported vision-language family of `config` (its model_type), or one line saying why it is refused."""
    mt = config.get("model_type")
    shown = (config.get("architectures") or [mt])[0]
    if mt in FAMILIES:
        return mt
    if mt in NOT_YET:
        raise LlmqError(f"{shown} (model_type {mt!r}) is not supported yet: {NOT_YET[mt]}; llmq runs "
                        f"{', '.join(FAMILIES)} vision-language checkpoints")
    raise LlmqError(f"unsupported vision-language architecture {shown!r} (model_type {mt!r}); llmq runs "
                    f"{', '.join(FAMILIES)} vision-language checkpoints")


def hf_config(config: dict):
    """transformers' config object of a vision-language config.json (one line if it does not parse)."""
    from transformers import AutoConfig

    mt = family(config)
    try:
        return AutoConfig.for_model(mt, **{k: v for k, v in config.items()
                                           if k not in ("model_type", "quantization_config")})
    except Exception as e:  # transformers' validation raises its own error types
        raise LlmqError(f"config.json of this {mt} model is invalid: {str(e).splitlines()[-1].strip()}") from None


def language_config(config: dict) -> dict:
    """The language model's config.json as llmq's stages read it: for a vision-language checkpoint its text_config
    (transformers' defaults filled in, the checkpoint's dtype and quantization_config carried), else `config`."""
    if not is_multimodal(config):
        return config
    text = hf_config(config).text_config.to_dict()
    if text.get("final_logit_softcapping") is not None and config["model_type"] in SOFTCAP_IGNORED:   # Gemma 3's
        # checkpoints leave it null
        raise LlmqError(f"{config['model_type']} text_config final_logit_softcapping="
                        f"{text['final_logit_softcapping']!r} is not supported: transformers' "
                        f"{config.get('architectures', ['?'])[0]} ignores it where its text model applies it")
    text["model_type"] = FAMILIES[config["model_type"]]
    text.pop("architectures", None)
    for k in ("dtype", "torch_dtype", "quantization_config"):
        if k in config:
            text[k] = config[k]
    return text


def runs_images(vision: str | None) -> bool:
    """Whether llmq's runtime takes images for a checkpoint of this vision-language family (ModelSpec.vision)."""
    return vision is not None and vision not in TEXT_ONLY


def text_name(stored: str) -> str | None:
    """A stored tensor's name in the language model's view, or None for the tower's and the projector's."""
    if stored.startswith(VISION_PREFIXES):
        return None
    for prefix, text in LANGUAGE_PREFIXES:
        if stored.startswith(prefix):
            return text + stored[len(prefix):]
    return stored


def tower_name(stored: str) -> str:
    """A tower / projector tensor's name without transformers' wrappers ("model.", the tower's "vision_model."):
    `vision_tower.<path in SigLIP's transformer>` or `multi_modal_projector.<name>`."""
    name = stored.removeprefix("model.")
    return name.replace("vision_tower.vision_model.", "vision_tower.", 1)


def check_tensors(vision: dict, where: str) -> None:
    """A tower / projector tensor that is not floating point is refused: stages copy them as stored, the runtime
    computes with them in its compute dtype. `vision`: stored name -> (dtype, shape)."""
    if not vision:
        raise LlmqError(f"{where}: a vision-language config.json but no vision_tower / multi_modal_projector tensors")
    for name, (dtype, _) in vision.items():
        if not dtype.is_floating_point:
            raise LlmqError(f"{where}: tensor {name} is {str(dtype).removeprefix('torch.')}; llmq reads vision "
                            "towers stored 16- or 32-bit only")


def load_processor(d):
    """The checkpoint's own processor (transformers' AutoProcessor: its image processor's resize and normalisation,
    the tokens an image takes in the prompt); one line when the directory lacks its config or it does not load."""
    from pathlib import Path

    if not any((Path(d) / f).is_file() for f in PROCESSOR_FILES):
        raise LlmqError(f"{d}: a vision-language checkpoint without its processor's config "
                        f"({' or '.join(PROCESSOR_FILES)}); copy it from the model's original repository")
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(str(d))
    except Exception as e:  # transformers raises many types for a config it cannot use
        raise LlmqError(f"{d}: its processor does not load ({(str(e).splitlines() or [''])[0][:200]})") from None


def check_quantize(opts, spec) -> None:
    """What quantize does not yet write for a vision-language model: one line each. The language model takes one
    scheme (its linears matched by class, the tower and projector in `ignore`); named-module groups (mixed precision,
    an INT8 head or embedding) would need module names that hold in both of transformers' layouts."""
    what = [flag for flag, on in (("--target-bpw / --max-size", opts.mixed), ("--lm-head int8", opts.lm_head == "int8"),
                                  ("--embedding int8", opts.embedding == "int8")) if on]
    if what:
        raise LlmqError(f"{spec.vision}: {what[0]} is not supported for vision-language models yet; quantize the "
                        "language model with one scheme (the tower and projector stay 16-bit)")
    if opts.method in ("bnb-int8", "bnb-nf4"):
        raise LlmqError(f"{spec.vision}: method {opts.method} would quantize the vision tower's linears too "
                        "(bitsandbytes skips modules by name only); use a compressed-tensors method")


def quantization_config(qc: dict) -> dict:
    """A language model's compressed-tensors config made to hold in the vision-language checkpoint: the tower and
    projector ignored (their linears are Linear modules too), the other ignored modules named by their path under
    the language model (a suffix of transformers' name in either layout)."""
    for g in qc.get("config_groups", {}).values():
        if any(t != "Linear" for t in g.get("targets") or ()):
            raise LlmqError("a named-module quantization group is not written for vision-language models yet")
    ignore = [m.removeprefix("model.") for m in qc.get("ignore") or ()]
    return qc | {"ignore": ignore + [p for p in VISION_IGNORE if p not in ignore]}


def manifest(vision: dict, images: int) -> dict:
    """The quantized artifact's record of the tower and projector: kept as stored, their dtype and size, and how many
    calibration samples were image conversations (the calibration record says which)."""
    import math

    dtypes = sorted({str(d).removeprefix("torch.") for d, _ in vision.values()})
    return {"format": f"{'/'.join(dtypes)} as stored (not quantized)", "tensors": len(vision),
            "parameters": sum(math.prod(s) for _, s in vision.values()),
            "calibration": f"{images} image conversations (calibration.image_conversations)" if images
            else "text only (no image)"}
