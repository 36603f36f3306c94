"""`llmq build --target gguf` against llama.cpp's loader contract, and an independent reader of the file.

The contract below is written from llama.cpp's GGUF documentation (docs/gguf.md in ggml), ggml's type enum and
block layouts (ggml.h, ggml-common.h) and its model loader (src/llama-model.cpp and src/models/: which tensors the
`llama`, `qwen2`, `qwen3` and `phi3` architectures create and with which shapes; src/llama-vocab.cpp: the tokenizer
keys). The reader applies
llama.cpp's semantics to the file (the block formats through the `gguf` package's dequantizer, `llama`'s adjacent-pair
RoPE undone on q/k) and runs transformers on what it read; its logits must match llmq's runtime on the artifact.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import runtime_logprobs

from llmq.errors import LlmqError
from llmq.models import resolve_model
from llmq.models.reader import CheckpointReader
from llmq.pipeline.quantize import QuantizeOptions, quantize
from llmq.pipeline.quantize.probe import kld_top1
from llmq.pipeline.targets import BuildOptions, build_engine

gguf = pytest.importorskip("gguf")

# ---------------------------------------------------------------- the contract, as data
# ggml_type ids (ggml.h) and the block layout of each: (weights per block, bytes per block).
GGML_TYPE_ID = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "BF16": 30}
BLOCK_BYTES = {"F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20),
               "Q5_0": (32, 22), "Q5_1": (32, 24)}
# GGUF value types (gguf.md): what llama.cpp's typed key reader accepts for each key.
UINT32, FLOAT32, BOOL, STRING, ARRAY, INT32 = 4, 6, 7, 8, 9, 5
GT_F32 = 0
REQUIRED_KEYS = {
    "general.architecture": STRING, "general.file_type": UINT32, "general.quantization_version": UINT32,
    "{arch}.context_length": UINT32, "{arch}.embedding_length": UINT32, "{arch}.block_count": UINT32,
    "{arch}.feed_forward_length": UINT32, "{arch}.attention.head_count": UINT32,
    "{arch}.attention.head_count_kv": UINT32, "{arch}.rope.dimension_count": UINT32,
    "{arch}.rope.freq_base": FLOAT32, "{arch}.attention.layer_norm_rms_epsilon": FLOAT32,
    "tokenizer.ggml.model": STRING, "tokenizer.ggml.pre": STRING, "tokenizer.ggml.tokens": ARRAY,
    "tokenizer.ggml.token_type": ARRAY, "tokenizer.ggml.merges": ARRAY, "tokenizer.ggml.bos_token_id": UINT32,
    "tokenizer.ggml.eos_token_id": UINT32, "tokenizer.ggml.add_bos_token": BOOL, "tokenizer.chat_template": STRING,
}
# The llama.cpp pre-tokenizer names of the regexes a tokenizer.json can carry (src/llama-vocab.cpp).
KNOWN_PRE = {"gpt-2", "smollm", "qwen2", "llama-bpe", "default"}
# general.file_type values (llama.h, enum llama_ftype).
FTYPE = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "BF16": 32}
# Which GGML type each kind of tensor has, per llmq scheme (1-D tensors are always F32 in llama.cpp files).
SCHEMES = {  # name: (QuantizeOptions or None, linear type)
    "bf16": (None, "BF16"),
    "w8-g32": (dict(bits=8, group_size=32), "Q8_0"),
    "w4-g32": (dict(bits=4, group_size=32), "Q4_0"),
    "w4-g32-asym": (dict(bits=4, group_size=32, symmetric=False), "Q4_1"),
    "w5-g32": (dict(bits=5, group_size=32), "Q5_0"),
    "w5-g32-asym": (dict(bits=5, group_size=32, symmetric=False), "Q5_1"),
    "w4-g32-head8": (dict(bits=4, group_size=32, lm_head="int8"), "Q4_0"),   # lm_head INT8 per channel: Q8_0
}


def expected_tensors(arch: str, c: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape in GGUF order, ne0 first; kind) that llama.cpp's loader creates for this config."""
    e, v, f = c["hidden_size"], c["vocab_size"], c["intermediate_size"]
    d = c.get("head_dim") or e // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    out = {"token_embd.weight": ((e, v), "embed"), "output_norm.weight": ((e,), "norm")}
    if not c.get("tie_word_embeddings"):
        out["output.weight"] = ((e, v), "lm_head")
    for i in range(c["num_hidden_layers"]):
        b = f"blk.{i}."
        out |= {b + "attn_norm.weight": ((e,), "norm"), b + "ffn_norm.weight": ((e,), "norm"),
                b + "attn_output.weight": ((q, e), "linear"), b + "ffn_down.weight": ((f, e), "linear")}
        if arch == "phi3":  # llama.cpp's phi3: q/k/v as one attn_qkv, gate and up as one ffn_up of 2 x n_ff rows
            out |= {b + "attn_qkv.weight": ((e, q + 2 * kv), "linear"), b + "ffn_up.weight": ((e, 2 * f), "linear")}
            continue
        out |= {b + "attn_q.weight": ((e, q), "linear"), b + "attn_k.weight": ((e, kv), "linear"),
                b + "attn_v.weight": ((e, kv), "linear"), b + "ffn_gate.weight": ((e, f), "linear"),
                b + "ffn_up.weight": ((e, f), "linear")}
        if arch == "qwen2":
            out |= {b + "attn_q.bias": ((q,), "norm"), b + "attn_k.bias": ((kv,), "norm"),
                    b + "attn_v.bias": ((kv,), "norm")}
        if arch == "qwen3":  # llama.cpp's qwen3: one RMSNorm weight per head dimension for q and for k
            out |= {b + "attn_q_norm.weight": ((d,), "norm"), b + "attn_k_norm.weight": ((d,), "norm")}
    return out


def expected_type(kind: str, linear_type: str, head_type: str = "BF16") -> str:
    return {"norm": "F32", "embed": "BF16", "lm_head": head_type, "linear": linear_type}[kind]


# ---------------------------------------------------------------- helpers
def _field(r, key):
    f = r.fields[key]
    return f.types[0], f.contents()


def gguf_file(engine_art) -> Path:
    meta = json.loads((engine_art.path / "engine.json").read_text())
    return engine_art.path / meta["outputs"]["gguf"]["file"]


def _bf16(d: Path, random_norms: bool = False) -> Path:
    """Store the tiny model in bf16, llmq's dtype; random_norms: norm weights drawn from [-0.5, 0.5] (transformers
    initialises them to one value), so that each norm's values matter."""
    from safetensors.torch import load_file, save_file

    st, g = d / "model.safetensors", torch.Generator().manual_seed(0)
    save_file({k: (torch.rand(v.shape, generator=g) - 0.5 if random_norms and k.endswith("norm.weight") else v)
               .to(torch.bfloat16 if v.is_floating_point() else v.dtype).contiguous()   # codes stay as they are
               for k, v in load_file(st).items()}, str(st), metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    cfg["dtype"] = "bfloat16"
    cfg.pop("torch_dtype", None)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _bf16_with_a_merge(d: Path) -> Path:
    """The tiny model in bf16, its byte tokenizer given one BPE merge, as real ones have."""
    tok = json.loads((_bf16(d) / "tokenizer.json").read_text())
    tok["model"]["vocab"]["\u0120t"] = 259
    tok["model"]["merges"] = [["\u0120", "t"]]
    (d / "tokenizer.json").write_text(json.dumps(tok))
    return d


TINY = {"llama-gqa": dict(num_attention_heads=4, num_key_value_heads=2),
        "qwen2-bias-tied": dict(model_type="qwen2", tie_word_embeddings=True),
        # head_dim 32 with hidden 64 and 4 heads: q is wider than the residual, as in Qwen3's releases
        "qwen3-qk-norm": dict(model_type="qwen3", head_dim=32, tie_word_embeddings=True),
        "phi3-fused": dict(model_type="phi3"),
        # 4 layers: llama.cpp's smollm3 leaves the rotary embedding out of every fourth, as transformers' default
        "smollm3-nope": dict(model_type="smollm3", num_hidden_layers=4)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(store, {(arch, scheme): (source artifact, gguf engine artifact)}) for both tiny models and every scheme."""
    from helpers import make_tiny_model

    from llmq.artifacts import Store

    root = tmp_path_factory.mktemp("gguf")
    store = Store(root / "store")
    built = {}
    for i, (arch, kw) in enumerate(TINY.items()):
        model = resolve_model(str(_bf16_with_a_merge(make_tiny_model(root / arch, seed=10 + i, **kw))), store)
        for scheme, (qopts, _) in SCHEMES.items():
            src = model if qopts is None else quantize(model, QuantizeOptions(method="rtn", **qopts), store,
                                                       progress=False)
            # probe_tokens=0: the modelled quality is test_gguf_compute's
            built[arch, scheme] = (src, build_engine(src, store, BuildOptions(target="gguf", probe_tokens=0)))
    return store, built


# ---------------------------------------------------------------- (a) the loader contract
@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("arch", list(TINY))
def test_file_meets_llama_cpp_loader_contract(tiny, arch, scheme):
    _, built = tiny
    src, art = built[arch, scheme]
    cfg = json.loads((src.path / "config.json").read_text())
    r = gguf.GGUFReader(gguf_file(art))
    a = cfg["model_type"] if cfg["model_type"] in ("qwen2", "qwen3", "phi3", "smollm3") else "llama"
    assert _field(r, "GGUF.version")[1] == 3
    for key, vtype in REQUIRED_KEYS.items():
        assert r.fields[key.format(arch=a)].types[0] == vtype, key
    linear_type = SCHEMES[scheme][1]
    assert _field(r, "general.architecture")[1] == a
    assert _field(r, "general.file_type")[1] == FTYPE[linear_type]
    assert _field(r, "general.quantization_version")[1] == 2
    heads = cfg["num_attention_heads"]
    want = {"block_count": cfg["num_hidden_layers"], "context_length": cfg["max_position_embeddings"],
            "embedding_length": cfg["hidden_size"], "feed_forward_length": cfg["intermediate_size"],
            "attention.head_count": heads, "attention.head_count_kv": cfg["num_key_value_heads"],
            "rope.dimension_count": cfg.get("head_dim") or cfg["hidden_size"] // heads}
    if cfg.get("head_dim", cfg["hidden_size"] // heads) != cfg["hidden_size"] // heads:  # n_embd_head_k / _v
        want |= {"attention.key_length": cfg["head_dim"], "attention.value_length": cfg["head_dim"]}
    for k, v in want.items():
        assert _field(r, f"{a}.{k}")[1] == v, k
    assert _field(r, f"{a}.rope.freq_base")[1] == pytest.approx(
        cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])  # transformers 5 nests it
    assert _field(r, f"{a}.attention.layer_norm_rms_epsilon")[1] == pytest.approx(cfg["rms_norm_eps"], rel=1e-6)

    tensors = {t.name: t for t in r.tensors}
    expected = expected_tensors(a, cfg)
    assert set(tensors) == set(expected)
    for name, (shape, kind) in expected.items():
        t, typ = tensors[name], expected_type(kind, linear_type, "Q8_0" if scheme.endswith("head8") else "BF16")
        assert t.tensor_type == GGML_TYPE_ID[typ], name
        assert tuple(int(x) for x in t.shape) == shape, name
        per_block, nbytes = BLOCK_BYTES[typ]
        assert shape[0] % per_block == 0, name
        assert t.n_bytes == int(np.prod(shape)) // per_block * nbytes, name
        assert t.data_offset % 32 == 0, name   # general.alignment defaults to 32

    tok = json.loads((src.path / "tokenizer.json").read_text())
    tokens = _field(r, "tokenizer.ggml.tokens")[1]
    types = _field(r, "tokenizer.ggml.token_type")[1]
    assert len(tokens) == len(types) == cfg["vocab_size"]
    assert all(tokens[i] == t for t, i in tok["model"]["vocab"].items())
    special = {a_["id"] for a_ in tok["added_tokens"] if a_["special"]}
    assert {i for i, t in enumerate(types) if t == 3} == special          # CONTROL
    assert all(t == 5 for t in types[len(tok["model"]["vocab"]):])        # UNUSED padding rows
    assert _field(r, "tokenizer.ggml.model")[1] == "gpt2"
    assert _field(r, "tokenizer.ggml.pre")[1] in KNOWN_PRE
    assert _field(r, "tokenizer.ggml.merges")[1] == ["\u0120 t"]
    assert _field(r, "tokenizer.ggml.bos_token_id")[1] == cfg["bos_token_id"]
    assert _field(r, "tokenizer.ggml.eos_token_id")[1] == cfg["eos_token_id"]
    assert not _field(r, "tokenizer.ggml.add_bos_token")[1]                # the byte tokenizer adds no BOS
    chat = json.loads((src.path / "tokenizer_config.json").read_text()).get("chat_template") or \
        (src.path / "chat_template.jinja").read_text()
    assert _field(r, "tokenizer.chat_template")[1] == chat


_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
          r"\s+(?!\S)|\s+")
_SPLIT = {"type": "Split", "behavior": "Isolated", "invert": False}
_BYTES = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True}


@pytest.mark.parametrize("pre,name", [
    ({**_BYTES, "use_regex": True}, "gpt-2"),
    ({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True},
                                            {**_BYTES, "use_regex": True}]}, "smollm"),
    ({"type": "Sequence", "pretokenizers": [{**_SPLIT, "pattern": {"Regex": _QWEN2}},
                                            {**_BYTES, "use_regex": False}]}, "qwen2"),
    ({"type": "Sequence", "pretokenizers": [{**_SPLIT, "pattern": {"Regex": _QWEN2.replace(r"\p{N}|", r"\p{N}{1,3}|")}},
                                            {**_BYTES, "use_regex": False}]}, "llama-bpe"),
    ({**_BYTES, "use_regex": False}, None),                       # no split at all: llama.cpp has no such mode
])
def test_pre_tokenizer_is_named_only_when_llama_cpp_splits_the_same_way(pre, name):
    from llmq.pipeline.targets.gguf_meta import pre_tokenizer_name

    assert pre_tokenizer_name({"normalizer": None, "pre_tokenizer": pre}) == name
    assert pre_tokenizer_name({"normalizer": {"type": "NFC"}, "pre_tokenizer": pre}) is None


# ---------------------------------------------------------------- (b) the independent reader
def _unpair_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's `llama` q/k rows (per head, RoPE pairs adjacent: 2i, 2i+1) back to Hugging Face's (i, i + d/2)."""
    d = w.shape[0] // heads
    return w.reshape(heads, d // 2, 2, -1).transpose(0, 2, 1, 3).reshape(heads * d, -1)


HF_NAMES = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
            "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
            "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output.weight": "self_attn.o_proj.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
            "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight"}
# llama.cpp's phi3 holds what Phi-3 itself stores fused: attn_qkv (q, k, v rows) and ffn_up (gate, then up rows)
PHI3_NAMES = {"attn_qkv": "self_attn.qkv_proj", **HF_NAMES, "ffn_up.weight": "mlp.gate_up_proj.weight"}


def read_gguf(path: Path, unpair: bool = True):
    """(transformers model, metadata) from a GGUF file alone, the way llama.cpp reads it."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        SmolLM3Config,
        SmolLM3ForCausalLM,
    )

    r = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("tokenizer.ggml.")}
    arch = meta["general.architecture"]
    g = lambda k: meta[f"{arch}.{k}"]  # noqa: E731
    heads, kv_heads = g("attention.head_count"), g("attention.head_count_kv")
    names = {t.name for t in r.tensors}
    cfg = dict(vocab_size=len(r.fields["tokenizer.ggml.tokens"].contents()), hidden_size=g("embedding_length"),
               intermediate_size=g("feed_forward_length"), num_hidden_layers=g("block_count"),
               num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=g("rope.dimension_count"),
               rms_norm_eps=g("attention.layer_norm_rms_epsilon"), rope_theta=g("rope.freq_base"),
               max_position_embeddings=g("context_length"), tie_word_embeddings="output.weight" not in names,
               pad_token_id=None)  # a padding row changes no logits (Phi-3's default, 32000, is past this vocab)
    if f"{arch}.attention.key_length" in meta:
        cfg["head_dim"] = g("attention.key_length")
    model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
                 "qwen3": (Qwen3Config, Qwen3ForCausalLM), "phi3": (Phi3Config, Phi3ForCausalLM),
                 # llama.cpp's smollm3 rotates no fourth layer, whatever the file says (n_no_rope_layer_step = 4)
                 "smollm3": (SmolLM3Config, SmolLM3ForCausalLM)}[arch]
    state = {}
    for t in r.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(x) for x in reversed(t.shape)])
        if arch in ("llama", "smollm3") and unpair and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            w = _unpair_rope_rows(w, heads if "attn_q" in t.name else kv_heads)
        state[_hf_name(t.name, arch)] = torch.from_numpy(np.array(w, dtype=np.float32))
    model = model_cls[1](model_cls[0](**cfg)).float().eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected
    assert set(missing) <= ({"lm_head.weight"} if cfg["tie_word_embeddings"] else set())
    return model, meta


def _hf_name(name: str, arch: str = "llama") -> str:
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    _, i, rest = name.split(".", 2)
    for g, hf in (PHI3_NAMES if arch == "phi3" else HF_NAMES).items():
        if rest.startswith(g):
            return f"model.layers.{i}.{hf}{rest[len(g):]}"
    raise AssertionError(f"unexpected tensor {name}")


def exact_artifact_model(src_path: Path):
    """transformers over the artifact's own weights, each quantized linear dequantized as (q - z) * s in float32:
    what the file must reproduce exactly, free of the runtime's kernel rounding."""
    from transformers import AutoConfig, AutoModelForCausalLM

    s = CheckpointReader(src_path)
    cfg = {k: v for k, v in s.config.items() if k != "quantization_config"}
    config = AutoConfig.for_model(**cfg)
    state = {k: s.tensor(k).float() for k in s.tensors if k.endswith("norm.weight") or k.endswith(".bias")}
    state["model.embed_tokens.weight"] = s.embedding().dense(torch.float32)
    for i in range(s.spec.num_layers):
        for path in s.spec.stored_linears(i).values():
            name = f"{s.arch.prefix(i)}.{path}"
            state[f"{name}.weight"] = s.linear(name).dense(torch.float32)
        state |= {f"{s.arch.prefix(i)}.{p}": t.float() for p, t in s.layer_tensors(i).items()}   # Gated DeltaNet's
    state["lm_head.weight"] = s.lm_head().dense(torch.float32)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    model.load_state_dict(_experts_fused(state, s.spec.num_experts), strict=True)
    return model


def _experts_fused(state: dict, experts: int) -> dict:
    """A checkpoint's per-expert linears (<block>.experts.<e>.<role>.weight) as transformers 5 holds them in memory:
    <block>.experts.gate_up_proj [experts, 2 x width, hidden] (gate rows first) and <block>.experts.down_proj."""
    import re

    out, found = {}, {}
    for k, v in state.items():
        m = re.fullmatch(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", k)
        if m:
            found.setdefault(m[1], {})[(int(m[2]), m[3])] = v
        else:
            out[k] = v
    for block, w in found.items():
        stack = lambda role: torch.stack([w[e, role] for e in range(experts)])  # noqa: E731
        out[f"{block}.gate_up_proj"] = torch.cat([stack("gate"), stack("up")], dim=1)
        out[f"{block}.down_proj"] = stack("down")
    return out


def reader_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().log_softmax(-1)


TOKENS = [int(x) for x in torch.randint(0, 256, (48,), generator=torch.Generator().manual_seed(0))]


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("arch", list(TINY))
def test_reader_reproduces_llmq_runtime_logits(tiny, arch, scheme):
    _, built = tiny
    src, art = built[arch, scheme]
    model, _ = read_gguf(gguf_file(art))
    got = reader_logprobs(model, TOKENS)
    # the runtime's INT4 kernels take bf16 activations
    assert kld_top1(runtime_logprobs(src.path, TOKENS), got)["kld_mean"] <= 1e-3
    # The file itself is exact: the artifact computed in float32 gives the same distribution (Q4_1 / Q5_1: up to the
    # fp16 rounding of their mins, which adds up over layers: 5e-8..1.9e-6 over 2..4 layers).
    bound = 1e-6 * (model.config.num_hidden_layers if scheme.endswith("asym") else 1)
    assert kld_top1(reader_logprobs(exact_artifact_model(src.path), TOKENS), got)["kld_mean"] <= bound


def test_reader_would_catch_llama_rope_rows_left_in_hugging_face_order(tiny):
    """The KLD bound has teeth: reading q/k without undoing llama.cpp's pairing is far off on the tiny model."""
    _, built = tiny
    src, art = built["llama-gqa", "w4-g32"]
    model, _ = read_gguf(gguf_file(art), unpair=False)
    assert kld_top1(runtime_logprobs(src.path, TOKENS), reader_logprobs(model, TOKENS))["kld_mean"] > 1e-2


def _rope_adjacent_pairs(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """llama.cpp's normal RoPE (the `llama` architecture): rotates (x[2i], x[2i+1]) by pos * theta^(-2i/d)."""
    d = x.shape[-1]
    ang = pos[:, None, None] * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    a, b = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * ang.cos() - b * ang.sin(), a * ang.sin() + b * ang.cos()
    return out


def _rope_half_pairs(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Hugging Face's Llama RoPE: rotates (x[i], x[i + d/2]) by pos * theta^(-2i/d)."""
    d = x.shape[-1]
    ang = pos[:, None, None] * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    a, b = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([a * ang.cos() - b * ang.sin(), a * ang.sin() + b * ang.cos()], dim=-1)


def test_llama_q_k_rows_give_the_same_attention_under_llama_cpp_rope(tiny):
    """The file's q/k under llama.cpp's adjacent-pair RoPE score exactly as the source's under Hugging Face's."""
    _, built = tiny
    src, art = built["llama-gqa", "bf16"]
    s = CheckpointReader(src.path)
    tensors = {t.name: t for t in gguf.GGUFReader(gguf_file(art)).tensors}
    x = torch.randn(7, s.spec.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(7, dtype=torch.float64) * 5
    d, rep = s.spec.head_dim, s.spec.num_heads // s.spec.num_kv_heads

    def scores(wq, wk, rope):
        q = rope((x @ wq.T).view(7, -1, d), pos, s.spec.rope_theta)
        k = rope((x @ wk.T).view(7, -1, d), pos, s.spec.rope_theta).repeat_interleave(rep, dim=1)
        return torch.einsum("thd,uhd->htu", q, k)

    def from_file(name):
        t = tensors[name]
        return torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64))

    hf = scores(s.tensor("model.layers.0.self_attn.q_proj.weight").double(),
                s.tensor("model.layers.0.self_attn.k_proj.weight").double(), _rope_half_pairs)
    cpp = scores(from_file("blk.0.attn_q.weight"), from_file("blk.0.attn_k.weight"), _rope_adjacent_pairs)
    assert torch.allclose(hf, cpp, rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------- (c) bit-exact integers and scales
def decode_blocks(t) -> dict[str, np.ndarray]:
    """The raw fields of Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 blocks per ggml-common.h: d (and m) fp16, for Q5 the
    uint32 qh (little endian, bit j = the fifth bit of weight j), then the quants; the 16 bytes of nibbles hold
    weight j in the low nibble of byte j and weight j + 16 in the high nibble. q is signed: n - 8 (Q4), n - 16 (Q5)."""
    typ = {v: k for k, v in GGML_TYPE_ID.items()}[int(t.tensor_type)]
    rows = t.data.shape[0]
    b = t.data.reshape(rows, -1, BLOCK_BYTES[typ][1])
    out = {"d": b[..., 0:2].copy().view(np.float16)[..., 0], "half": 16 if typ.startswith("Q5") else 8}
    if typ == "Q8_0":
        out["q"] = b[..., 2:].copy().view(np.int8).reshape(rows, -1).astype(np.int16)
        return out
    at = 2
    if typ.endswith("_1"):
        out["m"] = b[..., 2:4].copy().view(np.float16)[..., 0]
        at = 4
    n = np.concatenate([b[..., at + 4 * (typ[1] == "5"):] & 0xF, b[..., at + 4 * (typ[1] == "5"):] >> 4],
                       axis=-1).astype(np.int16)
    if typ.startswith("Q5"):
        qh = b[..., at:at + 4].copy().view("<u4")[..., 0].astype(np.int64)
        n |= (((qh[..., None] >> np.arange(32)) & 1) << 4).astype(np.int16)
    out["q"] = (n - out["half"]).reshape(rows, -1)
    return out


def _source_rows(qw, name: str, spec):
    """The artifact's integers, scales and zeros in the file's row order (q/k rows paired for `llama`)."""
    q, s, z = qw.q.numpy().astype(np.int16), qw.scale.float().numpy(), qw.zero_point
    z = None if z is None else z.numpy().astype(np.int16)
    if spec.arch.gguf_permutes_qk and name.endswith(("q_proj", "k_proj")):  # llama.cpp's `llama`, `smollm3`
        heads = spec.num_heads if name.endswith("q_proj") else spec.num_kv_heads
        d = q.shape[0] // heads
        order = np.arange(heads * d).reshape(heads, 2, d // 2).transpose(0, 2, 1).reshape(-1)
        q, s = q[order], s[order]
        z = None if z is None else z[order]
    return q, s, z


def assert_bit_exact(src_path: Path, gguf_path: Path) -> dict:
    """Every quantized linear: integers equal, d == the artifact's scale, Q4_1's m == fp16(-(8 + z) * s)."""
    s = CheckpointReader(src_path)
    tensors = {t.name: t for t in gguf.GGUFReader(gguf_path).tensors}
    to_file = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
               "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down", "qkv_proj": "attn_qkv",
               "gate_up_proj": "ffn_up"}
    stats = {"linears": 0, "weights": 0, "blocks": 0, "scales_not_exact": 0, "mins_rerounded": 0}
    for i in range(s.spec.num_layers):
        for name in s.arch.linear_names(i):
            qw = s.linear(name).qw
            blocks = decode_blocks(tensors[f"blk.{i}.{to_file[name.rsplit('.', 1)[1]]}.weight"])
            q, scale, zero = _source_rows(qw, name, s.spec)
            np.testing.assert_array_equal(blocks["q"], q, err_msg=name)
            per_block = np.repeat(scale, blocks["d"].shape[1] // scale.shape[1], axis=1)
            stats["scales_not_exact"] += int((blocks["d"].astype(np.float32) != per_block).sum())
            if zero is not None:
                zb = np.repeat(zero, blocks["d"].shape[1] // zero.shape[1], axis=1).astype(np.float32)
                m = -(blocks["half"] + zb) * per_block
                np.testing.assert_array_equal(blocks["m"], m.astype(np.float16), err_msg=name)
                stats["mins_rerounded"] += int((blocks["m"].astype(np.float32) != m).sum())
            stats["linears"] += 1
            stats["weights"] += q.size
            stats["blocks"] += blocks["d"].size
    return stats


@pytest.mark.parametrize("scheme", ["w8-g32", "w4-g32", "w4-g32-asym", "w5-g32", "w5-g32-asym"])
@pytest.mark.parametrize("arch", list(TINY))
def test_integers_and_scales_read_back_bit_exact(tiny, arch, scheme):
    _, built = tiny
    src, art = built[arch, scheme]
    stats = assert_bit_exact(src.path, gguf_file(art))
    cfg = json.loads((src.path / "config.json").read_text())   # Phi-3 stores 4 linears a layer, the others 7
    linears = cfg["num_hidden_layers"] * (4 if arch.startswith("phi3") else 7)
    assert stats["linears"] == linears
    assert stats["scales_not_exact"] == 0   # bf16 scales are fp16 numbers here
    rounding = json.loads((art.path / "engine.json").read_text())["outputs"]["gguf"]["rounding"]
    assert rounding["scales_rerounded_to_fp16"] == 0
    assert rounding["blocks"] == stats["blocks"]
    assert rounding["mins_rerounded_to_fp16"] == stats["mins_rerounded"]
    assert (stats["mins_rerounded"] > 0) == scheme.endswith("asym")


def test_per_channel_and_wider_groups_map_exactly_by_repeating_the_scale(tiny):
    """A group of 64 columns (or a whole row) is two (or k/32) blocks with the same d: still exact."""
    store, built = tiny
    model = built["llama-gqa", "bf16"][0]
    for opts in (dict(bits=4, group_size=64), dict(bits=8)):   # INT8 default: per output channel
        src = quantize(model, QuantizeOptions(method="rtn", **opts), store, progress=False)
        art = build_engine(src, store, BuildOptions(target="gguf"))
        assert assert_bit_exact(src.path, gguf_file(art))["scales_not_exact"] == 0


@pytest.mark.parametrize("target, widths", [(6, {4, 8}), (10, {8, 16})])
def test_mixed_precision_gives_each_tensor_its_own_block_type_and_the_same_logits(tiny, target, widths):
    """`--target-bpw`: a linear at 4 bits is Q4_0, at 8 Q8_0, at 16 the dense dtype, each as the artifact stores it,
    and the file computes what llmq's runtime computes."""
    store, built = tiny
    model = built["llama-gqa", "bf16"][0]
    src = quantize(model, QuantizeOptions(method="rtn", bits=4, group_size=32, target_bpw=target, num_samples=4,
                                          seq_len=64, probe_tokens=0), store, progress=False)
    art = build_engine(src, store, BuildOptions(target="gguf"))
    chosen = {f"model.layers.{u['layer']}.{m}": u["bits"] for u in src.config["mixed_precision"]["units"]
              for m in u["modules"]}
    assert set(chosen.values()) == widths
    r = gguf.GGUFReader(gguf_file(art))
    types = {_hf_name(t.name): t.tensor_type for t in r.tensors if t.name.startswith("blk.")}
    for name, bits in chosen.items():
        assert types[f"{name}.weight"] == GGML_TYPE_ID[{4: "Q4_0", 8: "Q8_0", 16: "BF16"}[bits]], name
    got = reader_logprobs(read_gguf(gguf_file(art))[0], TOKENS)
    assert kld_top1(reader_logprobs(exact_artifact_model(src.path), TOKENS), got)["kld_mean"] <= 1e-6


@pytest.mark.parametrize("arch", list(TINY))
def test_an_int8_embedding_table_is_q8_0_token_embd_read_back_exact(tiny, arch):
    """`quantize --embedding int8`: token_embd is Q8_0 with the artifact's integers and row scales; a tied model has
    no output tensor (llama.cpp's output is that table); the file computes what the artifact computes."""
    store, built = tiny
    model = built[arch, "bf16"][0]
    src = quantize(model, QuantizeOptions(method="rtn", bits=4, group_size=32, embedding="int8", probe_tokens=0),
                   store, progress=False)
    art = build_engine(src, store, BuildOptions(target="gguf"))
    tensors = {t.name: t for t in gguf.GGUFReader(gguf_file(art)).tensors}
    assert tensors["token_embd.weight"].tensor_type == GGML_TYPE_ID["Q8_0"]
    assert ("output.weight" in tensors) is not CheckpointReader(src.path).spec.tie_word_embeddings
    qw = CheckpointReader(src.path).embedding().qw
    blocks = decode_blocks(tensors["token_embd.weight"])
    np.testing.assert_array_equal(blocks["q"], qw.q.numpy())
    used = qw.q.abs().amax(1).numpy() > 0   # an all-zero (padding) row's tiny scale is no fp16 number: it reads 0
    assert (blocks["d"].astype(np.float32) == qw.scale.float().numpy())[used].all()   # the row scale, every block
    got = reader_logprobs(read_gguf(gguf_file(art))[0], TOKENS)
    assert kld_top1(reader_logprobs(exact_artifact_model(src.path), TOKENS), got)["kld_mean"] <= 1e-6


# ---------------------------------------------------------------- (d) refusals
@pytest.mark.parametrize("arch", ["llama-gqa", "phi3-fused"])
def test_gptq_artifacts_carry_llama_cpps_importance_matrix_of_their_calibration(tiny, arch):
    """GPTQ keeps each linear's mean squared input; the GGUF target writes them as llama-imatrix's GGUF file (the
    loader contract of common/imatrix-loader.cpp: `<tensor>.in_sum2` and `<tensor>.counts`, F32, under the model
    file's tensor names; datasets, chunk count and size) and its values are the inputs' statistics, computed here
    independently for layer 0 with transformers on the same calibration windows."""
    from transformers import AutoModelForCausalLM

    from llmq.models.load import load_tokenizer
    from llmq.pipeline.quantize.calib import load_calibration

    store, built = tiny
    model = built[arch, "bf16"][0]
    opts = QuantizeOptions(method="gptq", bits=4, group_size=32, num_samples=4, seq_len=32, probe_tokens=0)
    art = quantize(model, opts, store, progress=False)
    eng = build_engine(art, store, BuildOptions(target="gguf"))
    record = json.loads((eng.path / "engine.json").read_text())["outputs"]["gguf"]["imatrix"]
    r = gguf.GGUFReader(eng.path / record["file"])
    assert _field(r, "general.type")[1] == "imatrix"
    assert _field(r, "imatrix.chunk_count")[1] == 4
    assert _field(r, "imatrix.chunk_size")[1] == 32
    assert _field(r, "imatrix.datasets")[0] == ARRAY
    t = {x.name: x for x in r.tensors}
    linears = {x.name for x in gguf.GGUFReader(gguf_file(eng)).tensors if x.name.startswith("blk.")
               and x.name.endswith(".weight") and len(x.shape) == 2}
    assert {n.removesuffix(".in_sum2") for n in t if n.endswith(".in_sum2")} == linears
    assert all(t[f"{n}.in_sum2"].tensor_type == t[f"{n}.counts"].tensor_type == GT_F32 for n in linears)
    tokens = 4 * 32
    assert record["tokens"] == tokens
    assert all(float(np.asarray(t[f"{n}.counts"].data).reshape(-1)[0]) == tokens for n in linears)
    # layer 0's inputs, independently: the float model's attention norm and MLP norm outputs on the same windows
    windows = load_calibration(None, load_tokenizer(model.path), 4, 32, opts.seed, True, "auto").samples
    hf = AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32).eval()
    seen: dict[str, list[torch.Tensor]] = {"attn": [], "mlp": []}
    layer = hf.model.layers[0]
    layer.input_layernorm.register_forward_hook(lambda m, a, out: seen["attn"].append(out.reshape(-1, out.shape[-1])))
    layer.post_attention_layernorm.register_forward_hook(
        lambda m, a, out: seen["mlp"].append(out.reshape(-1, out.shape[-1])))
    with torch.no_grad():
        for w in windows:
            hf(w[None])
    qkv = "blk.0.attn_qkv.weight" if arch == "phi3-fused" else "blk.0.attn_k.weight"
    for name, key in ((qkv, "attn"), ("blk.0.ffn_up.weight", "mlp")):
        want = torch.cat(seen[key]).double().pow(2).mean(0)
        got = torch.from_numpy(np.asarray(t[f"{name}.in_sum2"].data, np.float64).reshape(-1)) / tokens
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
    rtn = built[arch, "w4-g32"][1]  # round-to-nearest has no calibration: no file
    assert json.loads((rtn.path / "engine.json").read_text())["outputs"]["gguf"]["imatrix"] is None


def _one_line_refusal(store, src, opts, *words):
    """build_engine raises one LlmqError line naming the way out, and leaves no engine behind."""
    before = len(list(store.root.rglob("engine.json")))
    with pytest.raises(LlmqError) as e:
        build_engine(src, store, opts)
    msg = str(e.value)
    assert "\n" not in msg, msg
    assert all(w in msg for w in words), msg
    assert len(list(store.root.rglob("engine.json"))) == before


def test_what_gguf_cannot_hold_is_refused_in_one_line(tiny, make_tiny_model, tmp_path):
    store, built = tiny
    model = built["llama-gqa", "bf16"][0]
    _one_line_refusal(store, model, BuildOptions(target="gguf", tp=2), "--tp 1", "llama.cpp")
    g16 = quantize(model, QuantizeOptions(method="rtn", bits=4, group_size=16), store, progress=False)
    _one_line_refusal(store, g16, BuildOptions(target="gguf"), "--group-size 32")
    fp8 = quantize(model, QuantizeOptions(method="fp8"), store, progress=False)
    _one_line_refusal(store, fp8, BuildOptions(target="gguf"), "FP8")
    asym8 = quantize(model, QuantizeOptions(method="rtn", bits=8, group_size=32, symmetric=False), store,
                     progress=False)
    _one_line_refusal(store, asym8, BuildOptions(target="gguf"), "Q8_0", "`llmq quantize --sym`")
    swa = resolve_model(str(make_tiny_model(tmp_path / "swa", model_type="mistral", sliding_window=64)), store)
    _one_line_refusal(store, swa, BuildOptions(target="gguf"), "sliding-window")
    nope = resolve_model(str(make_tiny_model(tmp_path / "nope", model_type="smollm3", no_rope_layers=[1, 0])), store)
    _one_line_refusal(store, nope, BuildOptions(target="gguf"), "every fourth layer", "layers [1]")
    from llmq.pipeline.kvcache import KVOptions, quantize_kv

    kv = quantize_kv(model, store, KVOptions(kv="int8", granularity="tensor", num_samples=2, seq_len=32,
                                             probe_tokens=64), show_progress=False)
    _one_line_refusal(store, kv, BuildOptions(target="gguf"), "KV-cache", "--target llmq")


# ---------------------------------------------------------------- (e) the default model, GPTQ INT4 g64
@pytest.mark.integration
def test_default_model_gptq_w4_reads_back_bit_exact_and_reproduces_llmq(default_gptq, default_store):
    src = default_gptq   # the session's GPTQ (groups of 64: each written as two Q4_0 blocks with its scale)
    art = build_engine(src, default_store, BuildOptions(target="gguf", probe_tokens=0))   # quality: test_gguf_compute
    info = json.loads((art.path / "engine.json").read_text())["outputs"]["gguf"]
    assert info["tensor_types"] == {"BF16": 1, "F32": 61, "Q4_0": 210}   # tied: token_embd only, no output
    stats = assert_bit_exact(src.path, gguf_file(art))
    assert stats["linears"] == 210
    assert stats["scales_not_exact"] == info["rounding"]["scales_rerounded_to_fp16"] == 0

    r = gguf.GGUFReader(gguf_file(art))
    tok = json.loads((src.path / "tokenizer.json").read_text())
    assert _field(r, "tokenizer.ggml.pre")[1] == "gpt-2"                 # the artifact's ByteLevel regex split
    assert len(_field(r, "tokenizer.ggml.merges")[1]) == len(tok["model"]["merges"])
    assert _field(r, "tokenizer.chat_template")[1] == (src.path / "chat_template.jinja").read_text()

    from llmq.models import load_tokenizer

    text = ("The capital of France is Paris. def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + "
            "fibonacci(n - 2)\nOnce upon a time, in a small village, there lived an old baker.")
    ids = load_tokenizer(src.path).encode(text)
    got = reader_logprobs(read_gguf(gguf_file(art))[0], ids)
    # a KV cache sized from free memory: one 4096-token sequence of this model needs more than small_engine's 8 MiB
    kld = kld_top1(runtime_logprobs(src.path, ids, kv_cache_memory=None), got)["kld_mean"]
    exact = kld_top1(reader_logprobs(exact_artifact_model(src.path), ids), got)["kld_mean"]
    print(f"default GPTQ w4g64: {stats}; over {len(ids)} tokens the reader's KLD vs llmq's runtime is {kld:.3g}, "
          f"vs the artifact in float32 {exact:.3g}")
    assert kld <= 1e-3
    assert exact <= 1e-6


def test_cli_target_gguf_writes_one_file_and_refuses_tp2_in_one_line(tiny):
    from click.testing import CliRunner

    from llmq.cli.main import cli

    store, built = tiny
    src = built["qwen2-bias-tied", "w4-g32"][0]
    args = ["--store", str(store.root), "build", src.ref, "--target", "gguf"]
    r = CliRunner().invoke(cli, [*args, "--tp", "2"])
    assert r.exit_code == 2, r.output
    assert r.output.count("\n") == 1, r.output
    assert r.output.startswith("error: --target gguf"), r.output
    r = CliRunner().invoke(cli, [*args, "--name", "cli-gguf", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["config"]["options"]["target"] == "gguf"
    files = list((store.root / "cli-gguf").rglob("*.gguf"))
    assert len(files) == 1
    assert files[0].name.endswith(".Q4_0.gguf")


# ---------------------------------------------------------------- (f) Gemma 3: llama.cpp's `gemma3`
# Three layers, the middle one global: a pattern llama.cpp's default (five local to one global) would get wrong; a
# local rotary base of its own; query_pre_attn_scalar 20 where llama.cpp scales by head_dim 32 (q wider than the
# residual, as in Gemma 3 270M); a logit cap.
GEMMA = dict(model_type="gemma3_text", num_hidden_layers=3, head_dim=32, sliding_window=8, query_pre_attn_scalar=20,
             final_logit_softcapping=5.0, tie_word_embeddings=True,
             layer_types=["sliding_attention", "full_attention", "sliding_attention"],
             rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})
GEMMA_SCHEMES = ("bf16", "w4-g32")


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """{scheme: (source artifact, gguf engine artifact)} for a tiny Gemma 3 with a Gemma-shaped tokenizer."""
    from helpers import gemma_tokenizer, make_tiny_model

    from llmq.artifacts import Store

    root = tmp_path_factory.mktemp("gguf-gemma3")
    store = Store(root / "store")
    path = make_tiny_model(root / "gemma3", seed=7, tokenizer=gemma_tokenizer(), **GEMMA)
    model = resolve_model(str(_bf16(path, random_norms=True)), store)
    built = {}
    for scheme in GEMMA_SCHEMES:
        qopts = SCHEMES[scheme][0]
        src = model if qopts is None else quantize(model, QuantizeOptions(method="rtn", **qopts), store,
                                                   progress=False)
        built[scheme] = (src, build_engine(src, store, BuildOptions(target="gguf")))
    return built


GEMMA_NAMES = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
               "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


@pytest.mark.parametrize("scheme", GEMMA_SCHEMES)
def test_gemma3_file_meets_llama_cpp_gemma3_contract(gemma, scheme):
    """llama.cpp's gemma3 loader (src/models/gemma3.cpp): its keys, its tensors and shapes, and the norms stored as
    the (1 + w) it multiplies by, the q norm also carrying query_pre_attn_scalar^-1/2 over llama.cpp's
    head_dim^-1/2."""
    src, art = gemma[scheme]
    cfg = json.loads((src.path / "config.json").read_text())
    r = gguf.GGUFReader(gguf_file(art))
    assert _field(r, "general.architecture")[1] == "gemma3"
    want = {"block_count": 3, "embedding_length": 64, "feed_forward_length": 128, "attention.head_count": 4,
            "attention.head_count_kv": 2, "attention.key_length": 32, "attention.value_length": 32,
            "rope.dimension_count": 32, "attention.sliding_window": 8, "context_length": 512}
    for k, v in want.items():
        assert _field(r, f"gemma3.{k}") == (UINT32, v), k
    pattern = r.fields["gemma3.attention.sliding_window_pattern"]
    assert pattern.types == [ARRAY, BOOL]
    assert pattern.contents() == [True, False, True]
    for k, v in {"rope.freq_base": 10000.0, "rope.freq_base_swa": 100.0, "final_logit_softcapping": 5.0,
                 "attention.layer_norm_rms_epsilon": cfg["rms_norm_eps"]}.items():
        assert _field(r, f"gemma3.{k}")[0] == FLOAT32, k
        assert _field(r, f"gemma3.{k}")[1] == pytest.approx(v), k

    tensors = {t.name: t for t in r.tensors}
    shapes = {"token_embd.weight": (64, cfg["vocab_size"]), "output_norm.weight": (64,)}
    for i in range(3):
        b = f"blk.{i}."
        shapes |= {b + n + ".weight": (32,) if n in ("attn_q_norm", "attn_k_norm") else (64,) for n in GEMMA_NAMES}
        shapes |= {b + "attn_q.weight": (64, 128), b + "attn_k.weight": (64, 64), b + "attn_v.weight": (64, 64),
                   b + "attn_output.weight": (128, 64), b + "ffn_gate.weight": (64, 128),
                   b + "ffn_up.weight": (64, 128), b + "ffn_down.weight": (128, 64)}
    assert {n: tuple(int(x) for x in t.shape) for n, t in tensors.items()} == shapes   # tied: no output.weight

    s = CheckpointReader(src.path)
    q_factor = 20 ** -0.5 / 32 ** -0.5
    for name, t in tensors.items():
        if not name.endswith("norm.weight"):
            continue
        assert t.tensor_type == GGML_TYPE_ID["F32"], name
        hf = "model.norm.weight" if name == "output_norm.weight" else \
            f"model.layers.{name.split('.')[1]}.{GEMMA_NAMES[name.split('.')[2]]}.weight"
        want = s.tensor(hf).float().numpy() + 1
        np.testing.assert_allclose(t.data, want * q_factor if "attn_q_norm" in name else want, rtol=1e-6,
                                   err_msg=name)
    if scheme != "bf16":
        assert assert_bit_exact(src.path, gguf_file(art))["linears"] == 21   # GeGLU's gate/up/down as llama's


def llama_cpp_gemma3_logprobs(path: Path, ids: list[int]) -> torch.Tensor:
    """llama.cpp's gemma3 graph (src/models/gemma3.cpp) over the file alone, in float64: embeddings times
    sqrt(n_embd); per layer RMSNorm by the stored weight, q/k norms, NEOX RoPE with the sliding layers' own base,
    queries times 1/sqrt(head_dim), the window on the layers the pattern marks, post-attention norm, GELU(gate) * up,
    post-FFN norm; the final norm, the tied table and the logit cap."""
    r = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in r.fields.items() if k.startswith("gemma3.")}
    g = lambda k: meta[f"gemma3.{k}"]  # noqa: E731
    w = {t.name: torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float64)
                                  .reshape([int(x) for x in reversed(t.shape)])) for t in r.tensors}
    e, heads, kv, d, eps = g("embedding_length"), g("attention.head_count"), g("attention.head_count_kv"), \
        g("attention.key_length"), g("attention.layer_norm_rms_epsilon")
    n, pos = len(ids), torch.arange(len(ids), dtype=torch.float64)

    def norm(x, weight):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    def rope(x, base):   # NEOX: dimension i turns with i + d/2
        ang = pos[:, None, None] * base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        a, b = x[..., : d // 2], x[..., d // 2:]
        return torch.cat([a * ang.cos() - b * ang.sin(), a * ang.sin() + b * ang.cos()], dim=-1)

    x = w["token_embd.weight"][ids] * math.sqrt(e)
    for i in range(g("block_count")):
        p = lambda name: w[f"blk.{i}.{name}.weight"]  # noqa: E731
        local = g("attention.sliding_window_pattern")[i]
        h = norm(x, p("attn_norm"))
        q = norm((h @ p("attn_q").T).view(n, heads, d), p("attn_q_norm"))
        k = norm((h @ p("attn_k").T).view(n, kv, d), p("attn_k_norm"))
        v = (h @ p("attn_v").T).view(n, kv, d)
        base = g("rope.freq_base_swa") if local else g("rope.freq_base")
        q, k = rope(q, base) * d ** -0.5, rope(k, base)
        k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
        dist = pos[:, None] - pos[None, :]
        masked = (dist < 0) | ((dist >= g("attention.sliding_window")) if local else False)
        att = torch.einsum("thd,uhd->htu", q, k).masked_fill(masked, float("-inf")).softmax(-1)
        o = torch.einsum("htu,uhd->thd", att, v).reshape(n, heads * d) @ p("attn_output").T
        x = x + norm(o, p("post_attention_norm"))
        h = norm(x, p("ffn_norm"))
        f = (torch.nn.functional.gelu(h @ p("ffn_gate").T, approximate="tanh") * (h @ p("ffn_up").T)) @ \
            p("ffn_down").T
        x = x + norm(f, p("post_ffw_norm"))
    logits = norm(x, w["output_norm.weight"]) @ w.get("output.weight", w["token_embd.weight"]).T
    cap = g("final_logit_softcapping")
    return (cap * torch.tanh(logits / cap)).log_softmax(-1)


@pytest.mark.parametrize("scheme", GEMMA_SCHEMES)
def test_gemma3_file_computes_in_llama_cpp_what_llmq_computes(gemma, scheme):
    """llama.cpp's gemma3 forward over the file equals transformers' Gemma 3 over the artifact in float32 (the
    file is exact) and llmq's runtime (its kernels' rounding); 40 tokens cross the 8-token window."""
    src, art = gemma[scheme]
    ids = TOKENS[:40]
    got = llama_cpp_gemma3_logprobs(gguf_file(art), ids)
    assert kld_top1(reader_logprobs(exact_artifact_model(src.path), ids), got)["kld_mean"] <= 1e-6
    assert kld_top1(runtime_logprobs(src.path, ids), got)["kld_mean"] <= 1e-3


def llama_cpp_spm_tokenize(r, text: str) -> list[int]:
    """llama.cpp's SentencePiece tokenizer (src/llama-vocab.cpp, llm_tokenizer_spm) over the file's vocabulary:
    BOS when add_bos_token; user-defined tokens matched whole in the raw text; spaces as \u2581 (no prefix space
    when add_space_prefix is off); then the adjacent pair whose joined token scores highest is joined (leftmost on
    ties) until none is a token; a character that is no token is spelled as its <0xNN> bytes."""
    tokens = _field(r, "tokenizer.ggml.tokens")[1]
    scores, types = _field(r, "tokenizer.ggml.scores")[1], _field(r, "tokenizer.ggml.token_type")[1]
    ids = {t: i for i, t in reversed(list(enumerate(tokens)))}
    assert not _field(r, "tokenizer.ggml.add_space_prefix")[1]
    out = [_field(r, "tokenizer.ggml.bos_token_id")[1]] if _field(r, "tokenizer.ggml.add_bos_token")[1] else []
    user = sorted((t for t, ty in zip(tokens, types) if ty == 4), key=len, reverse=True)
    for piece in re.split("(" + "|".join(map(re.escape, user)) + ")", text) if user else [text]:
        if piece in user:
            out.append(ids[piece])
            continue
        syms = list(piece.replace(" ", "\u2581"))
        while True:
            pairs = [(scores[ids[a + b]], -j) for j, (a, b) in enumerate(zip(syms, syms[1:])) if a + b in ids]
            if not pairs:
                break
            j = -max(pairs)[1]
            syms[j:j + 2] = [syms[j] + syms[j + 1]]
        for sym in syms:
            out += [ids[sym]] if sym in ids else [ids[f"<0x{b:02X}>"] for b in sym.encode()]
    return out


def test_gemma3_tokenizer_is_sentencepiece_that_llama_cpp_splits_as_the_source(gemma):
    """tokenizer.ggml.model "llama" with scores in merge order (not id order: "bc" before "ab"), <0xNN> tokens BYTE,
    specials CONTROL, "\\n" USER_DEFINED, padding rows UNUSED; llama.cpp's algorithm over the file gives the source
    tokenizer's ids."""
    from llmq.models.load import load_tokenizer

    src, art = gemma["bf16"]
    r = gguf.GGUFReader(gguf_file(art))
    assert _field(r, "tokenizer.ggml.model")[1] == "llama"
    assert "tokenizer.ggml.merges" not in r.fields
    tokens, types = _field(r, "tokenizer.ggml.tokens")[1], _field(r, "tokenizer.ggml.token_type")[1]
    assert len(tokens) == len(types) == 320
    kinds = {i: ("BYTE" if t.startswith("<0x") else "CONTROL" if i < 5 else "USER_DEFINED" if t == "\n" else
                 "NORMAL") for i, t in enumerate(tokens[:276])}
    assert [gguf.TokenType(t).name for t in types] == [kinds[i] for i in range(276)] + ["UNUSED"] * 44
    assert [_field(r, f"tokenizer.ggml.{k}_token_id")[1] for k in ("bos", "eos", "unknown", "padding")] == [2, 1, 3, 0]
    tok = load_tokenizer(src.path)
    for text in ["the abc", " the\n\nabc bc ab", "éabcthe  the", "\nhe"]:
        assert llama_cpp_spm_tokenize(r, text) == tok(text).input_ids, text
