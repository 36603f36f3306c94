"""Does a rotation of the residual stream, folded offline into the weights (issue 53, item 1), help weight-only
round-to-nearest? A question for the next step, answered before building it into `llmq quantize`.

The model is loaded in float64 by transformers. Each RMSNorm gain is folded into the linears that read its output,
so the head is untied. Then one random orthogonal Q goes into:
- the embedding (E Q), q / k / v / gate / up (W Q) and the head (W Q);
- o / down (Q^T W).

The rotated model computes the same function, and its KLD against the original is printed. Then every decoder linear
of both is rounded to the symmetric integer grid with amax scales (embedding and head stay float64). Each one's mean
KLD against the float model is printed over the first --tokens tokens of a text, with the ratio.

    python benchmarks/rotation_weight_only.py [--model REF] [--text FILE] [--tokens 1024] [--seed 0]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmq.artifacts import Store  # noqa: E402
from llmq.models import resolve_model  # noqa: E402

PLAIN_NORMS = ("llama", "mistral", "qwen2", "qwen3")   # q / k norms act on heads, not on the residual stream
GRIDS = ((4, 32), (5, 32), (4, 64), (4, 0), (8, 0))   # (bits, group size); 0: per output channel


def _linears(layer):
    a, f = layer.self_attn, layer.mlp
    return (a.q_proj, a.k_proj, a.v_proj, a.o_proj, f.gate_proj, f.up_proj, f.down_proj)


@torch.no_grad()
def rotate(model, seed: int):
    """The same function with the residual stream rotated by a random orthogonal matrix (module docstring)."""
    hidden = model.config.hidden_size
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(hidden, hidden, dtype=torch.float64, generator=gen))
    emb = model.model.embed_tokens.weight
    head = emb if model.config.tie_word_embeddings else model.lm_head.weight
    model.lm_head.weight = torch.nn.Parameter(head * model.model.norm.weight @ q)
    model.model.embed_tokens.weight = torch.nn.Parameter(emb @ q)
    model.config.tie_word_embeddings = False
    model.model.norm.weight.fill_(1)
    for layer in model.model.layers:
        a, f = layer.self_attn, layer.mlp
        for lin, norm in ((a.q_proj, layer.input_layernorm), (a.k_proj, layer.input_layernorm),
                          (a.v_proj, layer.input_layernorm), (f.gate_proj, layer.post_attention_layernorm),
                          (f.up_proj, layer.post_attention_layernorm)):
            lin.weight.copy_(lin.weight * norm.weight @ q)
        layer.input_layernorm.weight.fill_(1)
        layer.post_attention_layernorm.weight.fill_(1)
        a.o_proj.weight.copy_(q.T @ a.o_proj.weight)
        f.down_proj.weight.copy_(q.T @ f.down_proj.weight)
    return model


@torch.no_grad()
def round_to_nearest(model, bits: int, group: int):
    qmax = 2 ** (bits - 1) - 1
    for layer in model.model.layers:
        for lin in _linears(layer):
            n, k = lin.weight.shape
            g = group or k
            if k % g:
                raise SystemExit(f"groups of {group} do not divide a linear's {k} inputs")
            w = lin.weight.reshape(n, k // g, g)
            s = w.abs().amax(-1, keepdim=True) / qmax
            lin.weight.copy_(((w / s).round().clamp(-qmax - 1, qmax) * s).reshape(n, k))
    return model


def main() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a model reference (default: the embedded default model)")
    p.add_argument("--store", default=None, help="artifact store (default: $LLMQ_STORE or ~/.local/share/llmq/store)")
    p.add_argument("--text", default=str(Path(__file__).resolve().parents[1] / "docs" / "quantize.md"))
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    path = resolve_model(args.model, Store.open(args.store)).path
    model_type = AutoConfig.from_pretrained(path).model_type
    if model_type not in PLAIN_NORMS:
        raise SystemExit(f"{model_type}: only models whose norms are x * w around plain residuals "
                         f"({', '.join(PLAIN_NORMS)}) fold this way; Gemma's (1 + w) and sandwich norms are not")
    text = Path(args.text).read_text()
    ids = torch.tensor([AutoTokenizer.from_pretrained(path)(text).input_ids[:args.tokens]])

    def load():
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()

    @torch.no_grad()
    def logprobs(model):
        return model(ids).logits[0].log_softmax(-1)

    def kld(model) -> float:
        got = logprobs(model)
        return float((ref.exp() * (ref - got)).sum(-1).mean())

    ref = logprobs(load())
    same = kld(rotate(load(), args.seed))
    print(f"{path.parent.name}, {ids.shape[1]} tokens; rotated in float64 against the original: KLD {same:.2e}")
    for bits, group in GRIDS:
        plain = kld(round_to_nearest(load(), bits, group))
        rotated = kld(round_to_nearest(rotate(load(), args.seed), bits, group))
        name = f"INT{bits} " + (f"g{group}" if group else "per channel")
        print(f"  {name:16s} KLD plain {plain:.4f}  rotated {rotated:.4f}  ratio {rotated / plain:.2f}")


if __name__ == "__main__":
    main()
