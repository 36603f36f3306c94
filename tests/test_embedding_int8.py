"""`llmq quantize --embedding int8`: the token embedding table at INT8 per row, a tied head being that same table.

The reference reader of the stored table is compressed-tensors' own decompressor (the layout is its pack-quantized
one for an Embedding); the reference model is transformers' float32 model of the source with every quantized weight
replaced by what the checkpoint stores, dequantized in float32. llmq's runtime, its TP build and its probe must
compute that model; transformers and TensorRT-LLM, which cannot hold a quantized embedding, refuse in one line.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import bf16_kernels_off, runtime_logprobs

from llmq.errors import LlmqError
from llmq.models import qformat
from llmq.models.arch import LLAMA
from llmq.models.reader import CheckpointReader
from llmq.pipeline.quantize.probe import kld_top1

COMMON = dict(method="rtn", bits=4, group_size=32, num_samples=4, seq_len=64, probe_tokens=256, scales="amax")
IDS = [int(x) for x in torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(3))]


@pytest.fixture(scope="module")
def made(tmp_path_factory, tiny_model):
    """{tied: (store, source, INT8-table artifact, same options with a 16-bit table)} for a tiny bf16 model; "grouped":
    the tied model's table in groups of 32 (llama.cpp's Q8_0 blocks) with searched scales."""

    from llmq.artifacts import Store
    from llmq.models import resolve_model
    from llmq.pipeline.quantize import QuantizeOptions, quantize

    root = tmp_path_factory.mktemp("emb8")
    out = {}
    for tied in (True, False):
        path = tiny_model(seed=11, name=f"tiny-{tied}", bf16=True, tie_word_embeddings=tied)
        store = Store(root / f"store-{tied}")
        src = resolve_model(str(path), store)
        out[tied] = (store, src, quantize(src, QuantizeOptions(embedding="int8", **COMMON), store, progress=False),
                     quantize(src, QuantizeOptions(**COMMON), store, progress=False))
    grouped = QuantizeOptions(embedding="int8", int8_group_size=32, **dict(COMMON, scales="search"))
    out["grouped"] = (*out[True][:2], quantize(out[True][1], grouped, out[True][0], progress=False), out[True][3])
    return out


def _decompressed_table(ck: CheckpointReader) -> torch.Tensor:
    """The stored table as compressed-tensors' own decompressor reads it (scales in float32: nothing re-rounded)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    cfg = ck.config["quantization_config"]
    (group,) = [g for g in cfg["config_groups"].values() if g["targets"] == [qformat.EMBEDDING]]
    prefix = qformat.EMBEDDING + "."
    stored = {k[len(prefix):]: ck.tensors[k] for k in ck.tensors if k.startswith(prefix)}
    stored["weight_scale"] = stored["weight_scale"].float()
    compressor = BaseCompressor.get_value_from_registry(cfg["format"])
    return compressor.decompress(stored, QuantizationScheme.model_validate(group))["weight"].float()


def _reference_logprobs(src_path, art_path, ids) -> torch.Tensor:
    """transformers' float32 model of the source with the artifact's weights dequantized in float32."""
    from transformers import AutoModelForCausalLM

    ck = CheckpointReader(art_path)
    model = AutoModelForCausalLM.from_pretrained(src_path, dtype=torch.float32).eval()
    with torch.no_grad():
        for i in range(ck.spec.num_layers):
            for name in LLAMA.linear_names(i):
                model.get_submodule(name).weight.data = ck.linear(name).dense(torch.float32)
        table = _decompressed_table(ck) if ck.embedding_quantized() else ck.embedding().dense(torch.float32)
        model.model.embed_tokens.weight.data = table  # a tied lm_head shares this very tensor
        return model(torch.tensor([ids])).logits[0].double().log_softmax(-1)


@pytest.mark.parametrize("tied", [True, False])
def test_the_table_is_int8_per_row_in_its_own_group_and_the_file_shrinks(made, tied):
    store, src, art, plain = made[tied]
    ck = CheckpointReader(art.path)
    source_table = CheckpointReader(src.path).tensor("model.embed_tokens.weight").float()
    cfg = ck.config["quantization_config"]
    groups = {tuple(g["targets"]): g["weights"] for g in cfg["config_groups"].values()}
    assert groups[(qformat.EMBEDDING,)] == {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                                             "dynamic": False}
    assert "model.embed_tokens.weight" not in ck.tensors
    assert ck.embedding_quantized()
    assert ck.config["tie_word_embeddings"] is tied
    assert ck.has_lm_head() is not tied
    assert ("lm_head" in art.config["excluded_modules"]) is not tied   # a tied head is the INT8 table
    if tied:
        assert art.config["scheme_per_module"]["lm_head"] == "W8A16-channel-sym"
        assert ck.lm_head().qw is not None
    else:
        assert ck.lm_head().qw is None
        assert "lm_head" in cfg["ignore"]   # --lm-head decides an untied head
    # round to nearest on one scale per row: absmax / 127 rounded up to the model's bf16
    qw = ck.embedding().qw
    scale, exact = qw.scale.float(), source_table.abs().amax(1, keepdim=True) / 127
    assert qw.bits == 8
    assert qw.scale.dtype == torch.bfloat16
    assert scale.shape == (source_table.shape[0], 1)
    assert ((scale >= exact) & ((scale <= exact * (1 + 2 ** -7)) | (exact == 0))).all()   # (the padding row is 0)
    assert ((_decompressed_table(ck) - source_table).abs() <= scale / 2 * (1 + 1e-6)).all()
    assert torch.equal(_decompressed_table(ck), qw.dequantize(torch.float32))
    # half the table's bytes less on disk (scales and the int32 packing's header aside); same bf16 reference size
    vocab, hidden = source_table.shape
    saved = plain.metrics["size_bytes"] - art.metrics["size_bytes"]
    assert vocab * hidden * 0.9 < saved <= vocab * hidden
    assert art.metrics["bf16_bytes"] == plain.metrics["bf16_bytes"]


def test_a_grouped_table_stores_q8_0_blocks_with_searched_scales(made):
    from llmq.pipeline.targets import BuildOptions, build_engine

    store, src, art, _ = made["grouped"]
    ck = CheckpointReader(art.path)
    groups = {tuple(g["targets"]): g["weights"] for g in ck.config["quantization_config"]["config_groups"].values()}
    assert groups[(qformat.EMBEDDING,)]["strategy"] == "group"
    assert groups[(qformat.EMBEDDING,)]["group_size"] == 32
    qw, table = ck.embedding().qw, CheckpointReader(src.path).tensor("model.embed_tokens.weight").float()
    assert qw.scale.shape == (table.shape[0], table.shape[1] // 32)
    assert torch.equal(_decompressed_table(ck), qw.dequantize(torch.float32))
    # groups of 32 with searched scales: less rounding error than one absmax scale per row
    per_row = CheckpointReader(made[True][2].path).embedding().qw.dequantize(torch.float32)
    assert float((qw.dequantize(torch.float32) - table).pow(2).sum()) < 0.8 * float((per_row - table).pow(2).sum())
    eng = build_engine(art, store, BuildOptions(target="gguf"))
    import gguf

    file = eng.path / json.loads((eng.path / "engine.json").read_text())["outputs"]["gguf"]["file"]
    (embd,) = [t for t in gguf.GGUFReader(file).tensors if t.name == "token_embd.weight"]
    assert embd.tensor_type == gguf.GGMLQuantizationType.Q8_0
    back = torch.from_numpy(gguf.quants.dequantize(embd.data, embd.tensor_type).copy()).reshape(table.shape)
    scale16 = qw.scale.to(torch.float16).float().repeat_interleave(32, 1)  # GGUF's fp16 block scales
    assert torch.equal(back.float(), qw.q.float() * scale16)


@pytest.mark.parametrize("tied", [True, False, "grouped"])
def test_the_runtime_computes_the_dequantized_reference(made, tied, monkeypatch):
    _, src, art, _ = made[tied]
    bf16_kernels_off(monkeypatch)
    ref = _reference_logprobs(src.path, art.path, IDS)
    got = runtime_logprobs(art.path, IDS)
    assert kld_top1(ref, got)["kld_mean"] < 1e-9
    # the check sees the table's rounding: the 16-bit source table is measurably not what runs
    plain = _reference_logprobs(src.path, made[tied][3].path, IDS)
    assert kld_top1(plain, got)["kld_mean"] > 1e-7


def test_the_probe_counts_the_table_and_matches_the_runtime(made):
    from llmq.models.load import load_tokenizer
    from llmq.pipeline.quantize.calib import load_probe_text
    from llmq.pipeline.quantize.probe import ProbeAccumulator

    _, src, art, plain = made[True]
    windows = [w.tolist() for w in load_probe_text(load_tokenizer(src.path), COMMON["probe_tokens"]).samples]
    acc = ProbeAccumulator()
    for w in windows:
        acc.add(runtime_logprobs(src.path, w), runtime_logprobs(art.path, w))
    # within the float32 noise that the INT4 kernel's bf16 activations amplify (5e-5 here with a 16-bit table too),
    # and far from the same layers' probe with the 16-bit table (1.6e-3 away)
    recorded = art.metrics["probe"]["kld_mean"]
    assert abs(acc.result()["kld_mean"] / recorded - 1) < 2e-4
    assert abs(plain.metrics["probe"]["kld_mean"] / recorded - 1) > 1e-3


def test_the_kv_budget_counts_the_tied_heads_own_copy_of_the_table(made):
    """runtime_bytes (what the KV-cache budget subtracts) covers what the engine really holds: the INT8 table for
    lookups and the head's packed copy of it."""
    from llmq.runtime import EngineConfig, LLMEngine

    _, _, art, _ = made[True]
    engine = LLMEngine(art.path, EngineConfig(kv_cache_memory=8 << 20, enable_prefix_caching=False))
    try:
        model = engine.runner.model
        tensors = [*model.named_parameters(), *model.named_buffers()]   # (not the rope table: sized by the context)
        held = sum(t.numel() * t.element_size() for n, t in tensors if not n.startswith("rotary."))
        assert held <= CheckpointReader(art.path).runtime_bytes(torch.float32) < 1.5 * held
    finally:
        engine.shutdown()


@pytest.mark.parametrize("parallel", [False, True])
def test_a_tp2_build_slices_the_table_and_passes_the_reference_check(made, parallel):
    from llmq.pipeline.targets import BuildOptions, build_engine

    store, _, art, _ = made[True]
    eng = build_engine(art, store, BuildOptions(tp=2, parallel_embedding=parallel, verify=True))
    assert eng.metrics["verify"]["passed"]
    rank = CheckpointReader(eng.path / "rank1")
    assert rank.embedding_quantized()
    assert rank.lm_head().qw is not None
    assert rank.lm_head().qw.bits == 8
    vocab = CheckpointReader(art.path).spec.vocab_size
    assert rank.embedding().shape[0] == (vocab // 2 if parallel else vocab)


def test_transformers_and_tensorrt_llm_refuse_in_one_line(made):
    from llmq.models.load import load_hf_model
    from llmq.pipeline.quantize import QuantizeOptions
    from llmq.pipeline.targets import BuildOptions, build_engine

    store, _, art, _ = made[True]
    with pytest.raises(LlmqError, match="embedding table is INT8") as e:
        build_engine(art, store, BuildOptions(target="trtllm"))
    assert "\n" not in str(e.value)
    assert "--target llmq or gguf" in str(e.value)
    with pytest.raises(LlmqError, match="transformers cannot load"):
        load_hf_model(art.path)
    with pytest.raises(LlmqError, match="--embedding int8 needs a weight-only method"):
        QuantizeOptions(method="smoothquant", bits=8, embedding="int8").check()
