"""What the tests share: tiny random models of every supported family (real checkpoints and tokenizers, made in a
second, offline), llmq's runtime and transformers over them (log-probs, logits, greedy outputs), and a live
`llmq serve` on a free port. KL divergence is llmq's own (`llmq.pipeline.quantize.probe.kld_top1`)."""

from __future__ import annotations

import json
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# family -> config overrides that exercise what it declares (biases, tied tables, head_dim != hidden / heads)
FAMILIES = {"llama": {}, "mistral": {"sliding_window": None}, "qwen2": {"tie_word_embeddings": True},
            "qwen3": {"head_dim": 24},
            # local layers slide over 8 of the 40 scored tokens with their own rotary base, beside a global one
            "gemma3_text": {"head_dim": 24, "sliding_window": 8, "query_pre_attn_scalar": 20,
                            "final_logit_softcapping": 5.0, "layer_types": ["sliding_attention", "full_attention"]},
            # 8 experts of width 32, 2 a token (renormalized in one family, not in the other)
            "qwen3_moe": {"head_dim": 24, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                          "norm_topk_prob": False},
            "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32},
            # fused qkv_proj / gate_up_proj, read by role; every layer slides over 8 of the 40 scored tokens
            "phi3": {"sliding_window": 8},
            # 4 layers: the last attends without the rotary embedding (no_rope_layer_interval 4, transformers' default)
            "smollm3": {"num_hidden_layers": 4},
            # hybrid: a Gated DeltaNet layer (2 key heads of 16, 4 value heads of 12), then full attention with its
            # output gate, q / k norms and a rotary embedding over a quarter of each head (tests/test_hybrid.py)
            "qwen3_5_text": {"head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                             "linear_key_head_dim": 16, "linear_value_head_dim": 12,
                             "layer_types": ["linear_attention", "full_attention"]},
            # the same hybrid with 8 experts of width 32 (2 a token) and a shared expert of width 48 for every MLP
            "qwen3_5_moe_text": {"head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                                 "linear_key_head_dim": 16, "linear_value_head_dim": 12,
                                 "layer_types": ["linear_attention", "full_attention"], "num_experts": 8,
                                 "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                 "shared_expert_intermediate_size": 48},
            # the same layers, its DeltaNet projections stored fused by key head; the chosen experts not renormalized
            "qwen3_next": {"head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                           "linear_key_head_dim": 16, "linear_value_head_dim": 12,
                           "layer_types": ["linear_attention", "full_attention"], "num_experts": 8,
                           "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                           "shared_expert_intermediate_size": 48, "norm_topk_prob": False},
            # sliding (8 of the 40 scored tokens) then full attention with sinks and biases on all four linears, 8
            # biased experts of width 32 (2 a token) under a clamped SwiGLU; transformers initializes the expert
            # biases to zero and the sinks small, so they are drawn at random (random_biases)
            "gpt_oss": {"head_dim": 16, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
                        "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32,
                        "swiglu_limit": 1.5, "random_biases": True},
            # sliding (8 of the 40 scored tokens, heads of 16) and global layers (heads of 32, a proportional rotary
            # table), the last two reading the first two's KV caches with MLPs twice as wide, per-layer inputs of 8
            # (tests/test_gemma4.py: its global layers' values as their keys, its norms and scalars drawn at random)
            "gemma4_text": {"num_hidden_layers": 4, "head_dim": 16, "global_head_dim": 32, "sliding_window": 8,
                            "layer_types": ["sliding_attention", "full_attention"] * 2, "num_kv_shared_layers": 2,
                            "use_double_wide_mlp": True, "hidden_size_per_layer_input": 8,
                            "vocab_size_per_layer_input": 320, "final_logit_softcapping": 5.0}}


def byte_tokenizer():
    """A byte-level BPE tokenizer with no merges: 256 byte tokens + 3 specials, every string round-trips."""
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    for s in SPECIALS:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token=None, chat_template=CHATML)


def gemma_tokenizer():
    """A Gemma-shaped tokenizer (transformers' GemmaTokenizer: BPE over characters with byte fallback, spaces as
    ▁, BOS added) of 276 tokens: Gemma's specials, a user-defined "\n", the 256 <0xNN> bytes, a few characters
    and the merges of "▁the" and "abc"; "bc" merges before "ab" though its id is higher (merge order need not
    follow ids)."""
    from tokenizers import AddedToken
    from transformers import GemmaTokenizer

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "\n"]
                                        + [f"<0x{b:02X}>" for b in range(256)]
                                        + ["▁", "a", "b", "c", "e", "h", "t", "ab", "bc", "th", "▁t", "he",
                                           "▁th", "▁the"])}
    merges = [("b", "c"), ("a", "b"), ("▁", "t"), ("t", "h"), ("▁t", "h"), ("▁th", "e"), ("h", "e")]
    tok = GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True)
    tok.add_tokens([AddedToken("\n", normalized=False)])
    return tok


def make_tiny_model(path: Path, seed: int = 0, tokenizer=None, **overrides) -> Path:
    """Save a random model (Llama unless model_type says another family; 2 layers, hidden 64, 4 heads / 2 KV heads
    by default) with `tokenizer` (default: the byte tokenizer) to `path`."""
    import torch
    from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM

    model_type = overrides.pop("model_type", "llama")
    random_biases = overrides.pop("random_biases", False)  # every bias and sink logit ~ N(0, 1)
    tok = tokenizer or byte_tokenizer()
    cfg = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6,
               tie_word_embeddings=False, initializer_range=0.1, bos_token_id=tok.bos_token_id,
               eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if "intermediate_size" not in CONFIG_MAPPING[model_type].__dataclass_fields__:
        del cfg["intermediate_size"]  # a MoE whose MLPs are all experts has no dense width (Qwen3.5-MoE)
    cfg.update(overrides)
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])  # Qwen3 / Gemma 3 default to 128 / 256
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg)).eval()
    if random_biases:
        with torch.no_grad():
            for name, t in model.named_parameters():
                if name.endswith(("bias", "sinks")):
                    t.normal_()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def family_config(family: str) -> dict:
    """make_tiny_model's overrides for a declared family: what FAMILIES says it exercises (6 heads / 2 KV heads,
    hidden 96)."""
    return dict(model_type=family, num_attention_heads=6, num_key_value_heads=2, hidden_size=96, **FAMILIES[family])


def family_model(path: Path, family: str, seed: int = 4) -> Path:
    """A tiny random model of a declared family (family_config)."""
    return make_tiny_model(path, seed=seed, **family_config(family))


def tiny_bf16_store(d: Path, seed: int, **overrides):
    """(store, model artifact) of a tiny random model saved in bf16, in a fresh store under d."""
    return bf16_store(make_tiny_model(d / "tiny", seed=seed, **overrides), d)


def bf16_store(model_dir: Path, d: Path):
    """(store, model artifact) of a copy of model_dir saved in bf16 (how checkpoints ship), in a fresh store under d."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from llmq.artifacts import Store
    from llmq.models import resolve_model

    path = shutil.copytree(model_dir, d / "bf16")
    AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).save_pretrained(path)
    store = Store(d / "store")
    return store, resolve_model(str(path), store)


def decompressed_dense(art, out: Path) -> Path:
    """The quantized checkpoint as a dense one: every quantized linear decompressed by compressed-tensors' own
    compressor (scales in float32), everything else as stored, no quantization_config."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import save_file

    from llmq.models.reader import CheckpointReader

    ck = CheckpointReader(art.path)
    cfg = dict(ck.config)
    qcfg = cfg.pop("quantization_config")
    (group,) = qcfg["config_groups"].values()
    scheme = QuantizationScheme.model_validate(group)
    compressor = BaseCompressor.get_value_from_registry(qcfg["format"])
    modules = {k.rsplit(".", 1)[0] for k in ck.tensors if k.endswith(".weight_scale")}
    dense = {k: ck.tensors[k] for k in ck.tensors if k.rsplit(".", 1)[0] not in modules}
    for m in modules:
        stored = {k[len(m) + 1:]: ck.tensors[k] for k in ck.tensors if k.startswith(m + ".")}
        stored["weight_scale"] = stored["weight_scale"].float()
        dense[f"{m}.weight"] = compressor.decompress(stored, scheme)["weight"].float()
    out.mkdir()
    save_file({k: v.contiguous() for k, v in dense.items()}, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def fake_quantized_cache(kv: str, scales) -> str:
    """A transformers attention implementation that rounds K and V as a quantized cache stores them (int8:
    round(x / s) on [-128, 127]; fp8: x / s saturated to +-448 in e4m3), with each layer's stored scales (per tensor
    or per KV head), before sdpa: the reference for what a quantized cache computes, written from the format's
    definition rather than through llmq's runtime. `scales`: (k_scale, v_scale) by layer index (a list, or a dict of a
    hybrid model's attention layers)."""
    import sys

    import torch
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    def rounded(x, scale):
        s = scale.float().reshape(1, -1, 1, 1) if scale.numel() > 1 else scale.float().reshape(())
        if kv == "int8":
            return (x / s).round().clamp(-128, 127) * s
        return (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s

    def attention(module, query, key, value, attention_mask, **kw):
        k_scale, v_scale = scales[module.layer_idx]
        forward = sdpa_attention_forward
        if hasattr(module, "sinks"):   # GPT-OSS: its own eager attention, the one that has sinks
            forward = sys.modules[type(module).__module__].eager_attention_forward
        return forward(module, query, rounded(key, k_scale), rounded(value, v_scale), attention_mask, **kw)

    name = f"llmq_test_{kv}_cache"
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, eager_mask)   # always drawn (SDPA infers a causal one; eager cannot)
    return name


def kv_rounded_logits(path, ids, kv: str, scales):
    """transformers' float32 logits of ids [1, T] on the checkpoint at `path`: (plain, with K / V rounded as a
    quantized cache stores them under `scales`: fake_quantized_cache)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(ids).logits[0]
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                   attn_implementation=fake_quantized_cache(kv, scales)
                                                   ).eval()(ids).logits[0]
    return plain, ref


def llama_layer(seed: int, gen, tokens: int):
    """A float32 Llama decoder layer (hidden 64, eager attention) whose linears are seeded N(0, 0.1) draws from
    `gen`, and the keyword arguments it takes for a window of `tokens` positions."""
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                      num_hidden_layers=1)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    layer = LlamaDecoderLayer(cfg, 0).float()
    for lin in layer.modules():
        if isinstance(lin, torch.nn.Linear):
            lin.weight.data = torch.randn(lin.weight.shape, generator=gen) * 0.1
    pos = torch.arange(tokens)[None]
    kw = dict(position_embeddings=LlamaRotaryEmbedding(cfg)(torch.zeros(1, tokens, 64), pos), attention_mask=None,
              position_ids=pos)
    return layer, kw


def runtime_probe_kld(src_path, art_path, probe_tokens: int) -> float:
    """The quantize probe's measurement redone by llmq's runtime: mean KLD of the artifact against its source over
    the probe's held-out windows (small_engine each, one at a time)."""
    from llmq.models.load import load_tokenizer
    from llmq.pipeline.quantize.calib import load_probe_text
    from llmq.pipeline.quantize.probe import ProbeAccumulator

    windows = [w.tolist() for w in load_probe_text(load_tokenizer(src_path), probe_tokens).samples]
    base, quant = small_engine(src_path), small_engine(art_path)
    acc = ProbeAccumulator()
    for w in windows:
        acc.add(base.prompt_logprobs(w), quant.prompt_logprobs(w))
    base.shutdown()
    quant.shutdown()
    return acc.result()["kld_mean"]


def llmq_logits(source_dir, ids):
    """What llmq evaluated: its runtime's log-probs [batch, seq, vocab] over an artifact, one prompt per row of ids."""
    import torch

    from llmq.runtime import EngineConfig, LLMEngine

    eng = LLMEngine(source_dir, EngineConfig(max_num_seqs=2, max_model_len=64, kv_cache_memory=64 << 20))
    try:
        return torch.stack([eng.prompt_logprobs(row.tolist()) for row in ids])
    finally:
        eng.shutdown()


def small_engine(path, **config):
    """An LLMEngine over a tiny model: an 8 MiB KV cache and no prefix caching (every prompt computed whole), unless
    `config` (EngineConfig fields) says otherwise. The caller shuts it down."""
    from llmq.runtime import EngineConfig, LLMEngine

    return LLMEngine(path, EngineConfig(**({"kv_cache_memory": 8 << 20, "enable_prefix_caching": False} | config)))


def runtime_logprobs(path, ids, **config):
    """llmq's runtime's log-probs [len(ids), vocab] (float32) of one prompt, on a small_engine(path, **config)."""
    eng = small_engine(path, **config)
    try:
        return eng.prompt_logprobs(list(ids))
    finally:
        eng.shutdown()


def bf16_kernels_off(monkeypatch):
    """llmq's INT4 / INT5 / INT8 / Q4_K layers on their exact dequantize path instead of a bf16-activation kernel
    (PyTorch's tinygemm / int8pack or llmq's lowbit_linear_bf16 / q4k_linear), for comparisons at float32 rounding."""
    from llmq.runtime.layers import cpu_kernels, linear

    monkeypatch.setattr(cpu_kernels, "q4k_fits", lambda n, k: False)
    monkeypatch.setattr(linear, "_pack_int4", lambda *a, **k: None)
    monkeypatch.setattr(linear, "_lowbit", lambda *a, **k: None)
    monkeypatch.setattr(linear, "kernel_runs", lambda fn: False)


def hf_model(model_dir):
    """transformers' model of a checkpoint, in float32, for inference."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_logits(model_dir, ids: list[int]):
    """transformers' float32 logits [len(ids), vocab] of one prompt."""
    import torch

    with torch.no_grad():
        return hf_model(model_dir)(torch.tensor([ids])).logits[0]


def hf_greedy(model_dir, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """transformers' greedy continuations, exactly max_new tokens each (EOS ignored)."""
    import torch

    hf = hf_model(model_dir)
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False
                            )[0, len(p):].tolist() for p in prompts]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Live:
    def __init__(self, url: str, app, server):
        self.url, self.app, self.server = url, app, server
        self.fe = app.state.frontend

    def client(self, api_key: str = "none", **kw):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, **kw)

    def metrics(self) -> dict[str, float]:
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        key = self.fe.api_key
        text = httpx.get(f"{self.url}/metrics", headers={"Authorization": f"Bearer {key}"} if key else {}).text
        return {s.name + ("{" + s.labels["finished_reason"] + "}" if "finished_reason" in s.labels else ""): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}


@contextmanager
def live_server(model_dir, config, drain: float = 30.0, name: str = "tiny", **app_kw):
    """`llmq serve`'s app over model_dir with EngineConfig `config` on a free loopback port, for the with-block."""
    from llmq.runtime import LLMEngine
    from llmq.runtime.server import create_app, make_server, server_config

    engine = LLMEngine(model_dir, config)
    app = create_app(engine, served_model_name=name, **app_kw)
    port = free_port()
    server = make_server(server_config(app, port=port, log_level="warning", drain_timeout=drain))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive(), "uvicorn failed to start"
            time.sleep(0.02)
        yield Live(f"http://127.0.0.1:{port}", app, server)
    finally:
        server.should_exit = True
        thread.join(60)
        engine.shutdown()


def wait_for(cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


class Oracle:
    """A speculative proposer (runtime.speculative.Proposer's interface) of a sequence's true greedy continuation
    (`truth`: prompt -> plain greedy output), one token of it changed in a share `wrong` of the drafts (by default
    half): long accepted runs that cross block boundaries, and rejections anywhere in a draft."""

    name = "oracle"

    def __init__(self, truth: dict[tuple, list[int]], seed=0, wrong: float = 0.5):
        import random

        self.truth, self.rng, self.wrong = truth, random.Random(seed), wrong

    def propose(self, seqs, ks):
        out = []
        for s, k in zip(seqs, ks):
            full = self.truth[tuple(s.token_ids[:s.num_prompt_tokens])]
            draft = full[s.num_output_tokens:s.num_output_tokens + k]
            if draft and self.rng.random() < self.wrong:
                i = self.rng.randrange(len(draft))
                draft[i] ^= 1   # another token: greedy verification rejects it
            out.append(draft)
        return out, None

    def collect(self) -> None:
        pass

    def close(self) -> None:
        pass


def assert_refused_in_one_line(store, calls) -> None:
    """Each (call, words) raises an LlmqError of one line matching `words`, and the store holds what it held."""
    import pytest

    from llmq.errors import LlmqError

    before = sorted(p.name for p in store.root.iterdir())
    for call, words in calls:
        with pytest.raises(LlmqError, match=words) as e:
            call()
        assert "\n" not in str(e.value)
    assert sorted(p.name for p in store.root.iterdir()) == before
