"""Mixture-of-experts layers for calibration: transformers 5 keeps a layer's experts as two 3-D parameters, but a
quantizer needs one linear per expert (one weight, one Hessian, one scale set each, under the checkpoint's names).
`install` puts an `ExpertsBlock` in every layer of a streamed skeleton in place of transformers' block: the same
function (router softmax, top-k, renormalized where the family does, the chosen experts' SwiGLU outputs summed, plus
a shared expert's output scaled by its sigmoid gate where the family has one), with the checkpoint's per-expert
linears.

Routed calibration starves rare experts: an expert no calibration token picks would get no Hessian (GPTQ) and no
activation statistics (AWQ), and an expert few pick gets a poor estimate. While a quantizer collects statistics
(`every_expert`), each expert therefore runs on every calibration token (what it would compute had the router picked
it); the layer's output still sums the routed experts only, so later layers see the model's real hidden states. The
tokens the router did pick for each expert are counted (`routed`) and recorded in the manifest as its coverage.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from ...models.arch import MLP, Arch
from ...runtime.models.decoder import glu


class _Expert(nn.Module):
    """One expert's MLP: the family's gated activation (runtime.models.decoder.glu) between its linears, with
    biases where the family's experts have them (Experts.biased)."""

    def __init__(self, names: dict[str, str], hidden: int, width: int, bias: bool = False, activation: str = "silu",
                 swiglu: tuple[float, float] | None = None):
        super().__init__()
        self.names, self.activation, self.swiglu = names, activation, swiglu
        for role, (out, inp) in (("gate_proj", (width, hidden)), ("up_proj", (width, hidden)),
                                 ("down_proj", (hidden, width))):
            setattr(self, names[role], nn.Linear(inp, out, bias=bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.names
        gu = torch.cat([getattr(self, n["gate_proj"])(x), getattr(self, n["up_proj"])(x)], -1)
        return getattr(self, n["down_proj"])(glu(gu, self.activation, self.swiglu))


class ExpertsBlock(nn.Module):
    """A MoE MLP with one nn.Linear per expert matrix, the router, and a shared expert and its gate where the family
    has them (shared_width > 0), named as in the checkpoint."""

    def __init__(self, arch: Arch, hidden: int, width: int, count: int, top_k: int, renormalize: bool,
                 shared_width: int = 0, swiglu: tuple[float, float] | None = None):
        super().__init__()
        m = arch.moe
        self.top_k, self.renormalize, self.every_expert = top_k, renormalize, False
        self.router_name, self.experts_name = m.router, m.experts
        self.returns_scores = m.returns_scores
        setattr(self, m.router, nn.Linear(hidden, count, bias=m.biased))
        setattr(self, m.experts, nn.ModuleList(_Expert(m.names, hidden, width, m.biased, arch.activation, swiglu)
                                               for _ in range(count)))
        self.shared = (m.shared, m.shared_gate) if shared_width else None
        if shared_width:
            setattr(self, m.shared, _Expert({r: r for r in MLP}, hidden, shared_width))
            setattr(self, m.shared_gate, nn.Linear(hidden, 1, bias=False))
        self.routed = [0] * count  # tokens the router sent each expert in the last every_expert pass

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        logits = getattr(self, self.router_name)(x)
        weights, chosen = logits.float().softmax(-1).topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for e, expert in enumerate(getattr(self, self.experts_name)):
            rows, slot = torch.where(chosen == e)
            if self.every_expert:  # every token through every expert: full statistics, the routed rows kept
                self.routed[e] += int(rows.numel())
                y = expert(x)[rows]
            elif rows.numel():
                y = expert(x[rows])
            else:
                continue
            out.index_add_(0, rows, (y * weights[rows, slot, None]).to(out.dtype))
        if self.shared is not None:  # every token's, scaled per token
            expert, gate = (getattr(self, n) for n in self.shared)
            out += torch.sigmoid(gate(x)) * expert(x)
        out = out.reshape(shape)
        return (out, None) if self.returns_scores else out   # the layer drops the scores (training's aux loss)


def install(model: nn.Module, arch: Arch, config) -> None:
    """Replace every layer's transformers MoE block of a (meta-device) skeleton with an ExpertsBlock. Where
    transformers calls the block by another name than the checkpoint (Mixtral: `mlp` for `block_sparse_moe`), the
    layer keeps calling it by its name while its tensors are listed under the checkpoint's."""
    from ...models.spec import ModelSpec

    spec = ModelSpec.from_config(config.to_dict())
    m = arch.moe
    for layer in model.get_submodule(arch.layers):
        block = ExpertsBlock(arch, spec.hidden_size, spec.expert_size, spec.num_experts, spec.experts_per_token,
                             spec.renormalize, spec.shared_expert_size, spec.swiglu)
        module = m.module or m.block
        del layer._modules[module]
        setattr(layer, m.block, block)
        if module != m.block:
            object.__setattr__(layer, module, block)  # not a registered child: its tensors stay under m.block


def blocks(layer: nn.Module) -> list[ExpertsBlock]:
    return [b for b in layer.modules() if isinstance(b, ExpertsBlock)]


@contextmanager
def every_expert(layer: nn.Module):
    """Within: every expert of `layer` runs on every token, and the tokens routed to each are counted (afresh: every
    pass runs the same calibration tokens)."""
    found = blocks(layer)
    for b in found:
        b.every_expert = True
        b.routed = [0] * len(b.routed)  # the pass's own count
    try:
        yield
    finally:
        for b in found:
            b.every_expert = False


@contextmanager
def uncounted(layer: nn.Module):
    """Within (inside every_expert): passes that leave the routed counts as they were (GPTAQ's float-model passes
    route other states than the quantized model's)."""
    found = blocks(layer)
    saved = [list(b.routed) for b in found]
    try:
        yield
    finally:
        for b, counts in zip(found, saved):
            b.routed = counts


def expert_coverage(routed: list[list[int]] | None, calib) -> dict:
    """The manifest's record of how each expert was calibrated: the calibration tokens the router sent it, per
    layer, beside the tokens it saw (all of them), and the experts no token was routed to."""
    if routed is None:
        return {"scheme": "data-free: the method rounds every expert's weights without calibration"}
    return {"scheme": "every expert on every calibration token (routed outputs only passed on)",
            "tokens_per_expert": calib.tokens, "routed_tokens": routed,
            "never_routed": [[i, e] for i, row in enumerate(routed) for e, n in enumerate(row) if n == 0]}
