"""GPTQ of a Qwen3.5-MoE-shaped checkpoint at real layer width on this machine: seconds per layer and peak memory,
extrapolated to the full depth.

Not part of CI (the checkpoint is ~3.5 GB and GPTQ runs for tens of minutes on two cores). The checkpoint has random
bf16 weights and Qwen3.5-35B-A3B's layer shape (hidden 2048; 256 experts of 512, 8 a token, a shared expert of 512;
Gated DeltaNet layers with 16 key / 32 value heads of 128; attention with 16 heads / 2 KV heads of 256), truncated to
--layers layers of Qwen3.5's pattern (three Gated DeltaNet layers to one attention layer; 2 layers: one of each). Its
tensors are the ones llmq's own declaration names (ModelSpec), written one at a time, so making it needs no more
memory than one tensor. The vocabulary is the default model's (SmolLM2's 49,152 ids, its tokenizer): the embedding
and head are not the layer width this measures.

Then `llmq quantize --method gptq --bits 4` runs as its own process (bench_big_model.run_measured: wall time, the
process tree's peak RSS). The manifest's own figures are quoted: seconds per layer (layer_times_s) and the
process's peak RSS; the full model's GPTQ time is the measured rest plus every layer of each kind at its measured
time (Qwen3.5-35B-A3B: 40 layers, 30 Gated DeltaNet and 10 attention).

    python benchmarks/bench_moe_real_width.py --work /tmp/moe [--layers 2] [--num-samples 8] [--seq-len 128]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_big_model import MiB, run_measured  # noqa: E402

# Qwen3.5-35B-A3B's text model (its config.json's text_config), but for the depth and the vocabulary
SHAPE = dict(model_type="qwen3_5_moe_text", hidden_size=2048, num_attention_heads=16, num_key_value_heads=2,
             head_dim=256, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
             shared_expert_intermediate_size=512, linear_num_key_heads=16, linear_num_value_heads=32,
             linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
             max_position_embeddings=8192, tie_word_embeddings=False,
             rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
FULL_DEPTH = 40


def layer_types(n: int) -> list[str]:
    return ["full_attention" if (i + 1) % 4 == 0 or (n < 4 and i == n - 1) else "linear_attention" for i in range(n)]


def make_checkpoint(out: Path, shape: dict, layers: int, tokenizer_dir: Path, seed: int = 0) -> None:
    """A Qwen3.5-family checkpoint of `shape` (a config without depth and vocabulary) and `layers` layers of its
    pattern: random bf16 weights (linears normal with std 0.02; (1 + w) norms 0, the DeltaNet's gated norm 1; A_log
    log(1..16), dt_bias 1, the convolution std 0.2), every tensor llmq's declaration names, one in memory at a time."""
    import torch

    from llmq.models.arch import ARCHS
    from llmq.models.arch.base import EMBEDDING, LM_HEAD
    from llmq.models.checkpoint import ShardedWriter, copy_tokenizer
    from llmq.models.spec import ModelSpec

    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    config = dict(shape, num_hidden_layers=layers, layer_types=layer_types(layers), vocab_size=vocab,
                  architectures=[ARCHS[shape["model_type"]].architecture], bos_token_id=1, eos_token_id=2,
                  dtype="bfloat16")
    spec = ModelSpec.from_config(config)
    arch = spec.arch
    tensors = {f"{EMBEDDING}.weight": (vocab, spec.hidden_size), f"{LM_HEAD}.weight": (vocab, spec.hidden_size),
               f"{arch.final_norm}.weight": (spec.hidden_size,)}
    for i in range(layers):
        p = arch.prefix(i)
        tensors |= {f"{p}.{path}.weight": spec.linear_shape(n) for n, path in spec.stored_linears(i).items()}
        tensors |= {arch.norm(i, r): spec.norm_shape(r) for r in spec.norm_roles(i)}
        tensors |= {f"{p}.{path}": shape for path, shape in spec.linear_tensors(i).items()}
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    g = torch.Generator().manual_seed(seed)
    with ShardedWriter(tmp) as w:
        for k, (name, shape) in enumerate(sorted(tensors.items())):
            if name.endswith("linear_attn.norm.weight") or name.endswith("dt_bias"):
                t = torch.ones(shape)
            elif name.endswith("norm.weight"):
                t = torch.zeros(shape)
            elif name.endswith("A_log"):
                t = torch.linspace(1, 16, shape[0]).log()
            else:
                t = torch.randn(shape, generator=g) * (0.2 if "conv1d" in name else 0.02)
            w.add(name, t.to(torch.bfloat16))
            print(f"\rwriting {k + 1}/{len(tensors)} tensors", end="", file=sys.stderr, flush=True)
        w.close()
    print(file=sys.stderr)
    copy_tokenizer(tokenizer_dir, tmp)
    tmp.rename(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True, help="directory for the checkpoint and the store")
    ap.add_argument("--layers", type=int, default=2, help="layers of Qwen3.5's pattern (2: one of each kind)")
    ap.add_argument("--num-samples", type=int, default=8, help="calibration windows")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per calibration window")
    ap.add_argument("--probe-tokens", type=int, default=256, help="held-out tokens of the KLD probe")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--make-checkpoint", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    store, model = a.work / "store", a.work / f"qwen35moe-{a.layers}layers"
    if a.make_checkpoint:
        from llmq.artifacts import Store
        from llmq.models import resolve_model

        make_checkpoint(model, SHAPE, a.layers, resolve_model(None, Store.open(store)).path)
        return 0
    if not model.is_dir():  # in a child: this process stays small (a child's ru_maxrss starts from its parent's)
        import subprocess

        subprocess.run([sys.executable, __file__, "--make-checkpoint", "--work", str(a.work), "--layers",
                        str(a.layers)], check=True)
    name = f"{model.name}-gptq-w4"
    shutil.rmtree(store / name, ignore_errors=True)
    cmd = [sys.executable, "-m", "llmq", "--store", str(store), "quantize", str(model), "--method", "gptq",
           "--bits", "4", "--num-samples", str(a.num_samples), "--seq-len", str(a.seq_len), "--probe-tokens",
           str(a.probe_tokens), "--name", name]
    r = run_measured(cmd, a.work / "gptq.log")
    if r["rc"] != 0:
        print(f"llmq quantize failed: {r['error']}", file=sys.stderr)
        return 1
    manifest = json.loads(sorted((store / name).glob("v*/llmq.json"))[-1].read_text())
    m = manifest["metrics"]
    times, kinds = m["layer_times_s"], layer_types(a.layers)
    per_kind = {k: sorted(t for t, kk in zip(times, kinds) if kk == k) for k in set(kinds)}
    per_kind = {k: v[len(v) // 2] for k, v in per_kind.items()}
    full = {"linear_attention": FULL_DEPTH * 3 // 4, "full_attention": FULL_DEPTH // 4}
    rest = r["wall_s"] - sum(times)
    out = dict(layers=a.layers, calib_tokens=a.num_samples * a.seq_len, wall_s=r["wall_s"],
               layer_times_s=[round(t, 1) for t in times], layer_kinds=kinds,
               manifest_peak_rss_gib=round(m["peak_rss_bytes"] / 2**30, 2),
               tree_peak_rss_gib=round(r["peak_rss_mib"] * MiB / 2**30, 2),
               kld=(m.get("probe") or {}).get("kld_mean"), size_gib=round(m["size_bytes"] / 2**30, 2),
               full_depth_s=round(rest + sum(full[k] * per_kind[k] for k in full), 0),
               never_routed_experts=len(manifest["config"]["expert_coverage"]["never_routed"]))
    print(json.dumps(out, indent=2))
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
