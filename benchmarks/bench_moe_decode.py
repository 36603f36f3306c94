"""Batch-1 decode of a mixture-of-experts model: does a step read only the chosen experts, at memory speed?

A random Qwen3-MoE-shaped model far larger than the caches (default: 4 layers of 32 experts of width 768 over a 2048
residual, 8 experts a token, as Qwen3-30B-A3B's layers are shaped; ~1.3 GB in bf16) is written straight to
safetensors and run by the bundled runtime (the engine `llmq serve` runs), as stored and as INT4 RTN g32 made by
`llmq quantize`. For each: the median step time over --repeats runs of --steps decode steps after a 64-token prefill,
the bytes a step reads (attention, routers, norms and head as held, the chosen experts' weights as counted by the
runtime's SparseMoE, the KV cache), that over the step time against the machine's read bandwidth (MBU on active
bytes), and the same for the bytes of every expert, which is what a step would read if it ran the MoE densely.

    python benchmarks/bench_moe_decode.py [--experts 32] [--layers 4] [--steps 16] [--repeats 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from bench_serve_throughput import batch1_decode  # noqa: E402

from llmq.bench.hw import read_bandwidth  # noqa: E402
from llmq.runtime import EngineConfig  # noqa: E402


def write_model(path: Path, layers: int, experts: int, hidden: int, width: int, top_k: int) -> Path:
    """A random Qwen3-MoE checkpoint in bf16, tensor by tensor (no model object is built), with a byte tokenizer."""
    from helpers import byte_tokenizer
    from safetensors.torch import save_file

    tok = byte_tokenizer()
    heads, kv, head_dim, vocab = 16, 4, 128, 512
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": hidden,
           "intermediate_size": 4 * width, "moe_intermediate_size": width, "num_experts": experts,
           "num_experts_per_tok": top_k, "norm_topk_prob": True, "num_hidden_layers": layers,
           "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim, "vocab_size": vocab,
           "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False,
           "dtype": "bfloat16", "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}
    gen = torch.Generator().manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, generator=gen) * shape[-1] ** -0.5).to(torch.bfloat16)

    path.mkdir(parents=True)
    for i in range(layers):
        p = f"model.layers.{i}."
        t = {p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
             p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
             p + "self_attn.q_norm.weight": torch.ones(head_dim, dtype=torch.bfloat16),
             p + "self_attn.k_norm.weight": torch.ones(head_dim, dtype=torch.bfloat16),
             p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
             p + "self_attn.k_proj.weight": w(kv * head_dim, hidden),
             p + "self_attn.v_proj.weight": w(kv * head_dim, hidden),
             p + "self_attn.o_proj.weight": w(hidden, heads * head_dim), p + "mlp.gate.weight": w(experts, hidden)}
        for e in range(experts):
            t |= {p + f"mlp.experts.{e}.gate_proj.weight": w(width, hidden),
                  p + f"mlp.experts.{e}.up_proj.weight": w(width, hidden),
                  p + f"mlp.experts.{e}.down_proj.weight": w(hidden, width)}
        save_file(t, path / f"model-{i:05d}.safetensors", metadata={"format": "pt"})
    save_file({"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": torch.ones(hidden).bfloat16(),
               "lm_head.weight": w(vocab, hidden)}, path / "model-rest.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg))
    tok.save_pretrained(path)
    return path


def decode(path: Path, steps: int, peak_bw: float, experts: int, top_k: int) -> dict:
    """bench_serve_throughput's batch-1 decode (its bytes a step reads count the routed experts the runtime's
    SparseMoE read), and the same step time over every expert's bytes: at batch 1 a step reads top_k of each layer's
    experts, all of one shape, so every expert is expert_bytes x experts / top_k."""
    prompt = torch.randint(0, 256, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    r = batch1_decode(path, prompt, steps, peak_bw, EngineConfig(max_num_seqs=1, max_model_len=512))
    all_experts = r["expert_bytes"] * experts / top_k
    active = r["weight_bytes"] + r["kv_bytes"]
    return {"step_ms": r["step_ms"], "active_bytes": active, "expert_bytes_per_step": r["expert_bytes"],
            "all_expert_bytes": all_experts, "mbu_active": r["mbu"],
            "mbu_if_dense": (active - r["expert_bytes"] + all_experts) / (r["step_ms"] / 1e3) / peak_bw}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    from llmq.artifacts import Store
    from llmq.bench.hw import machine_key
    from llmq.models import resolve_model
    from llmq.pipeline.quantize import QuantizeOptions, quantize

    with tempfile.TemporaryDirectory() as tmp:
        src = write_model(Path(tmp) / "moe", args.layers, args.experts, args.hidden, args.width, args.top_k)
        store = Store(Path(tmp) / "store")
        model = resolve_model(str(src), store)
        variants = {"bf16": model.path,
                    "int4-rtn-g32": quantize(model, QuantizeOptions(bits=4, group_size=32, probe_tokens=0),
                                             store, progress=False).path}
        bw = read_bandwidth()
        print(f"{machine_key('cpu')}: read bandwidth {bw / 1e9:.1f} GB/s; {args.layers} layers x "
              f"{args.experts} experts (width {args.width}, hidden {args.hidden}), {args.top_k} a token")
        results = {}
        for name, path in variants.items():
            runs = [decode(path, args.steps, bw, args.experts, args.top_k) for _ in range(args.repeats)]
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            results[name] = med
            print(f"{name:14s} step {med['step_ms']:7.2f} ms  active {med['active_bytes'] / 1e6:7.1f} MB "
                  f"(experts {med['expert_bytes_per_step'] / 1e6:6.1f} of {med['all_expert_bytes'] / 1e6:7.1f} MB)"
                  f"  MBU active {med['mbu_active']:.0%}  if dense {med['mbu_if_dense']:.0%}")
    if args.json:
        args.json.write_text(json.dumps({"bandwidth": bw, "args": vars(args) | {"json": str(args.json)},
                                         "results": results}, indent=1))


if __name__ == "__main__":
    main()
