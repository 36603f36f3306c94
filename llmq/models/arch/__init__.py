"""The architecture families llmq runs, one declaration module each (see base.Arch). A new family is its module,
its line in ARCHS and its tests; docs/extending.md walks through one."""

from __future__ import annotations

from ...errors import LlmqError
from .base import ATTN, LINEARS, MLP, ROUTER, SHARED_GATE, SPLIT, Arch, Experts, expert_role, shared_role, split_of
from .gemma3 import GEMMA3
from .gemma4 import GEMMA4
from .gpt_oss import GPT_OSS
from .llama import LLAMA, MISTRAL, QWEN2
from .moe import MIXTRAL, QWEN3_MOE
from .phi3 import PHI3
from .qwen3 import QWEN3
from .qwen3_5 import QWEN3_5, QWEN3_5_MOE, QWEN3_NEXT
from .smollm3 import SMOLLM3

ARCHS: dict[str, Arch] = {a.model_type: a for a in (LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA3, PHI3, QWEN3_MOE, MIXTRAL,
                                                    SMOLLM3, QWEN3_5, QWEN3_5_MOE, QWEN3_NEXT, GPT_OSS,
                                                    GEMMA4)}


def supported() -> str:
    from ..vision import FAMILIES

    return ", ".join([f"{a.architecture} ({t})" for t, a in ARCHS.items()] +
                     [f"{ARCHS[text].architecture.replace('ForCausalLM', 'ForConditionalGeneration')} ({t}, with its "
                      "vision tower)" for t, text in FAMILIES.items()])


def arch_for(model_type: str | None, shown: str | None = None) -> Arch:
    """The declaration of `model_type`, or one line naming what is supported."""
    try:
        return ARCHS[model_type]
    except KeyError:
        raise LlmqError(f"unsupported architecture {shown or model_type!r} (model_type {model_type!r}); llmq "
                        f"supports: {supported()}") from None


__all__ = ["ARCHS", "ATTN", "Arch", "Experts", "GEMMA3", "GEMMA4", "GPT_OSS", "LINEARS", "LLAMA", "MISTRAL", "MIXTRAL",
           "MLP", "PHI3", "QWEN2", "QWEN3", "QWEN3_5", "QWEN3_5_MOE", "QWEN3_MOE", "QWEN3_NEXT", "ROUTER",
           "SHARED_GATE", "SMOLLM3", "SPLIT", "arch_for", "expert_role", "shared_role", "split_of", "supported"]
