"""Vision-language checkpoints (Gemma3ForConditionalGeneration): imported with the tower and projector carried as
stored, run by llmq's runtime on image + text prompts equal to transformers in float32 (whole prefill, chunked prefill
whatever the chunk, prefix caching keyed on the pixels), and what is refused in one line. A tiny random model
(tests/vlm.py) and generated images: nothing downloaded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import make_tiny_model
from vlm import image, make_tiny_vlm

from llmq.artifacts import Store
from llmq.errors import LlmqError

VOCAB = 320
ROOT = Path(__file__).resolve().parents[1]
CONVERSATION = [{"role": "user", "content": [{"type": "text", "text": "the abc"}, {"type": "image"},
                                             {"type": "text", "text": "abc the"}, {"type": "image"}]},
                {"role": "assistant", "content": "the bc abc the cab"}]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from llmq.models import resolve_model

    d = tmp_path_factory.mktemp("vlm")
    src = make_tiny_vlm(d / "src")
    return src, resolve_model(str(src), Store(d / "store"))


@pytest.fixture(scope="module")
def prompt(vlm):
    from llmq.runtime.images import ImagePrompt

    ip = ImagePrompt(vlm[1].path)
    text = ip.processor.apply_chat_template(CONVERSATION, tokenize=False)
    images = [image("digit", seed=1), image("shapes", seed=2)]
    ids, pixels = ip(text, images)
    return text, images, ids, pixels


@pytest.fixture(scope="module")
def reference(vlm, prompt):
    """transformers' float32 log-probabilities and greedy continuation of the prompt (its processor's inputs)."""
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    text, images, ids, _ = prompt
    hf = Gemma3ForConditionalGeneration.from_pretrained(vlm[0], dtype=torch.float32).eval()
    inputs = AutoProcessor.from_pretrained(vlm[0])(text=text, images=images, add_special_tokens=False,
                                                   return_tensors="pt")
    assert inputs["input_ids"][0].tolist() == ids
    assert inputs["token_type_ids"].sum() == 8   # 2 images x 4 tokens
    with torch.no_grad():
        lp = hf(**inputs).logits[0].double().log_softmax(-1)
        greedy = hf.generate(**inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    return lp, greedy


def engine(path, **cfg):
    from llmq.runtime import EngineConfig, LLMEngine

    return LLMEngine(path, EngineConfig(**({"kv_cache_memory": 8 << 20, "max_model_len": 160} | cfg)))


def run(eng, ids, pixels, max_tokens=1):
    """(log-probabilities [len(ids) - 1, vocab] of the prompt's positions, the greedy continuation)."""
    from llmq.runtime import SamplingParams

    out = eng.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                             prompt_logprobs=VOCAB), [pixels])[0]
    lp = torch.tensor([[e[t] for t in range(VOCAB)] for e in out.prompt_logprobs.entries]).double()
    return lp, out.output_token_ids


def kld(ref, got):
    return (ref.exp() * (ref - got)).sum(-1)


def answer_rows(ids):
    """The positions predicting the assistant's answer (after the last image's end)."""
    return slice(max(i for i, t in enumerate(ids) if t == 278) + 1, len(ids) - 1)


def test_import_keeps_the_checkpoint_and_carries_the_tower_as_stored(vlm):
    from safetensors import safe_open

    from llmq.models.reader import CheckpointReader

    src, art = vlm
    cfg = json.loads((art.path / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma3ForConditionalGeneration"]
    assert "vision_config" in cfg
    assert art.config["architecture"]["vision"] == "gemma3"
    assert art.config["architecture"]["architecture"] == "Gemma3ForCausalLM"   # the language model llmq runs
    assert (art.path / "processor_config.json").is_file()
    r = CheckpointReader(art.path)
    assert r.spec.num_layers == 2
    assert "model.layers.0.self_attn.q_proj.weight" in r.tensors
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        tower = [k for k in f.keys() if k.startswith(("vision_tower.", "multi_modal_projector."))]
        assert sorted(r.tensors.vision) == sorted(tower)
        assert len(tower) > 20
        for k in tower:
            assert torch.equal(r.tensors.vision_tensor(k), f.get_tensor(k))


def test_the_runtime_equals_transformers_on_an_image_prompt(vlm, prompt, reference):
    _, _, ids, pixels = prompt
    ref, greedy = reference
    eng = engine(vlm[1].path)
    try:
        lp, _ = run(eng, ids, pixels)
        out = run(eng, ids, pixels, max_tokens=8)[1]
    finally:
        eng.shutdown()
    assert kld(ref[:-1], lp)[answer_rows(ids)].max() <= 1e-5
    assert kld(ref[:-1], lp).max() <= 1e-5   # every position, the image tokens' own included
    assert out == greedy


@pytest.mark.parametrize("budget", [3, 5, 30])
def test_chunked_prefill_cuts_at_image_ends_and_stays_equal(vlm, prompt, reference, budget):
    """Budgets that would end a chunk inside an image (3, 5: the image's 4 tokens attend to each other both ways, so
    a chunk ends before it or takes it whole) and one that takes both images in one chunk."""
    _, _, ids, pixels = prompt
    eng = engine(vlm[1].path, max_num_batched_tokens=budget)
    try:
        lp, _ = run(eng, ids, pixels)
    finally:
        eng.shutdown()
    assert kld(reference[0][:-1], lp).max() <= 1e-5


def last(eng, ids, pixels):
    """The next-token log-probabilities [vocab] after the prompt (prefix caching applies: no prompt_logprobs)."""
    from llmq.runtime import SamplingParams

    out = eng.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, logprobs=VOCAB), [pixels])[0]
    return torch.tensor([out.new_logprobs[0][t] for t in range(VOCAB)]).double()


def test_prefix_cache_keys_hold_the_pixels(vlm, prompt, reference):
    from llmq.runtime.images import ImagePrompt

    text, _, ids, pixels = prompt
    other_ids, other = ImagePrompt(vlm[1].path)(text, [image("digit", seed=1), image("digit", seed=7)])
    assert other_ids == ids
    assert not torch.equal(other, pixels)
    second = [i for i, t in enumerate(ids) if t == 277][4]   # the second image's first token
    eng = engine(vlm[1].path, block_size=16)
    try:
        first = last(eng, ids, pixels)
        assert kld(reference[0][-1], first) <= 1e-5
        hits = eng.stats().prefix_cache_hits
        assert kld(first, last(eng, ids, pixels)) <= 1e-6
        assert eng.stats().prefix_cache_hits - hits == 16 * ((len(ids) - 1) // 16)   # every full block reused
        hits = eng.stats().prefix_cache_hits
        changed = last(eng, other_ids, other)   # the same tokens, the second image changed
        assert eng.stats().prefix_cache_hits - hits == 16 * (second // 16)   # only the blocks before it
        assert kld(first, changed) > 1e-3
    finally:
        eng.shutdown()
    fresh = engine(vlm[1].path, enable_prefix_caching=False)
    try:
        assert kld(last(fresh, other_ids, other), changed) <= 1e-6
    finally:
        fresh.shutdown()


def test_images_for_a_text_only_model_or_the_wrong_count_are_one_line(vlm, prompt, tmp_path):
    from llmq.runtime import SamplingParams

    _, _, ids, pixels = prompt
    eng = engine(vlm[1].path)
    try:
        with pytest.raises(LlmqError, match=r"2 image\(s\) but 1 run"):
            eng.add_request("a", ids[:ids.index(277) + 8], SamplingParams(max_tokens=1), pixels)
        assert not eng.has_unfinished()
    finally:
        eng.shutdown()
    text = engine(make_tiny_model(tmp_path / "text"))
    try:
        with pytest.raises(LlmqError, match="takes no images: it is text-only"):
            text.add_request("a", [1, 2, 3], SamplingParams(max_tokens=1), pixels)
    finally:
        text.shutdown()


def test_vision_language_checkpoints_llmq_does_not_run_are_refused_in_one_line(vlm, tmp_path):
    from llmq.models import ModelSpec, resolve_model

    src = vlm[0]
    cfg = json.loads((src / "config.json").read_text())
    for mt, why in (("qwen3_vl", "M-RoPE"), ("smolvlm", "SmolVLM"), ("llava", "unsupported")):
        with pytest.raises(LlmqError, match=why):
            ModelSpec.from_config(cfg | {"model_type": mt})
    capped = cfg | {"text_config": cfg["text_config"] | {"final_logit_softcapping": 30.0}}
    with pytest.raises(LlmqError, match="final_logit_softcapping"):
        ModelSpec.from_config(capped)
    bare = tmp_path / "bare"
    shutil.copytree(src, bare)
    (bare / "processor_config.json").unlink()
    store = Store(tmp_path / "store")
    with pytest.raises(LlmqError, match="without its processor's config"):
        resolve_model(str(bare), store)
    assert store.list() == []


def data_url(data: bytes, mime: str = "image/png") -> str:
    import base64

    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def chat_body(*parts, text: str = "abc the") -> dict:
    return {"model": "tiny", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]}


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def bomb_png(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height but holds one scanline: it must be refused from the header."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 7)) + \
        chunk(b"IEND", b"")


def test_serve_takes_data_url_images_and_refuses_bad_ones_in_one_line(vlm, tmp_path):
    import httpx
    from helpers import live_server
    from vlm import encoded

    from llmq.runtime import EngineConfig, LLMEngine, SamplingParams
    from llmq.runtime.images import ImagePrompt

    path = vlm[1].path
    digit, shapes = image("digit", seed=3), image("shapes", seed=4)
    # what the engine answers for this conversation, the images as the server decodes them (PNG round trip)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "abc the"}]}]
    ip = ImagePrompt(path)
    ids, pixels = ip(ip.processor.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                     [digit, shapes.convert("RGB")])
    eng = LLMEngine(path, EngineConfig(kv_cache_memory=8 << 20, max_model_len=160))
    try:
        want = eng.generate([ids], SamplingParams(max_tokens=4, temperature=0.0), [pixels])[0].text
    finally:
        eng.shutdown()
    good = chat_body(image_part(data_url(encoded(digit))), image_part(data_url(encoded(shapes, "JPEG"),
                                                                                "image/jpeg")))
    with live_server(path, EngineConfig(kv_cache_memory=8 << 20, max_model_len=160)) as live:
        with httpx.Client(base_url=live.url, timeout=60) as c:
            r = c.post("/v1/chat/completions", json=chat_body(image_part(data_url(encoded(digit))),
                                                              image_part(data_url(encoded(shapes)))))
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == want
            assert r.json()["usage"]["prompt_tokens"] == len(ids)
            assert c.post("/v1/chat/completions", json=good).status_code == 200   # JPEG too
            truncated = encoded(digit)[:60]
            for parts, why in [
                ((image_part("https://example.com/cat.png"),), "https URLs are refused"),
                ((image_part("file:///etc/passwd"),), "file URLs are refused"),
                ((image_part(data_url(encoded(digit), "image/gif")),), "MIME type 'image/gif'"),
                ((image_part(data_url(encoded(digit, "JPEG"))),), "not a readable PNG"),   # the type lies
                ((image_part("data:image/png;base64,!!!"),), "not valid base64"),
                ((image_part(data_url(bomb_png(60000, 60000))),), "more than 16,000,000 pixels"),
                ((image_part(data_url(bomb_png(5000, 5000))),), "5000 x 5000 image is refused"),
                ((image_part(data_url(truncated)),), "truncated or corrupt|not a readable"),
                ((image_part(data_url(encoded(digit))),) * 9, "at most 8"),
            ]:
                r = c.post("/v1/chat/completions", json=chat_body(*parts))
                msg = r.json()["error"]["message"]
                assert r.status_code == 400, (why, r.text)
                assert "\n" not in msg, (why, r.text)
                assert __import__("re").search(why, msg), (why, msg)
            r = c.post("/v1/chat/completions", json=chat_body(image_part(data_url(encoded(digit)))))
            assert r.status_code == 200   # still serving
    with live_server(make_tiny_model(tmp_path / "text"), EngineConfig(kv_cache_memory=8 << 20)) as live:
        with httpx.Client(base_url=live.url, timeout=60) as c:
            r = c.post("/v1/chat/completions", json=chat_body(image_part(data_url(encoded(digit)))))
            assert r.status_code == 400
            assert "text-only: image_url parts are refused" in r.json()["error"]["message"]
            assert c.post("/v1/chat/completions", json=chat_body()).status_code == 200


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_quantized_language_model_keeps_the_tower_and_runs_in_transformers_and_llmq(vlm, prompt, method,
                                                                                    monkeypatch):
    """The quantized artifact is the compressed-tensors export (what vLLM / SGLang load): the language model's
    linears quantized, the tower and projector as stored and in `ignore`, the processor's config beside them;
    transformers loads it and runs the image prompt, and llmq's runtime computes the same."""
    from helpers import bf16_kernels_off
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    from llmq.models.reader import CheckpointReader
    from llmq.pipeline.quantize import QuantizeOptions, quantize

    src, art = vlm
    text, images, ids, pixels = prompt
    q = quantize(art, QuantizeOptions(method=method, bits=4, group_size=16, num_samples=2, seq_len=32,
                                      probe_tokens=0), Store(art.path.parent.parent), progress=False)
    cfg = json.loads((q.path / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma3ForConditionalGeneration"]
    assert {"re:.*vision_tower.*", "re:.*multi_modal_projector.*"} <= set(cfg["quantization_config"]["ignore"])
    assert q.config["vision"]["format"] == "float32 as stored (not quantized)"
    assert (q.path / "processor_config.json").is_file()
    r, s = CheckpointReader(q.path), CheckpointReader(art.path)
    assert r.layer_linears(0)["q_proj"].qw is not None   # the language model is quantized
    assert sorted(r.tensors.vision) == sorted(s.tensors.vision)
    assert all(torch.equal(r.tensors.vision_tensor(n), s.tensors.vision_tensor(n)) for n in s.tensors.vision)
    hf = Gemma3ForConditionalGeneration.from_pretrained(q.path, dtype=torch.float32).eval()
    inputs = AutoProcessor.from_pretrained(q.path)(text=text, images=images, add_special_tokens=False,
                                                   return_tensors="pt")
    with torch.no_grad():
        ref = hf(**inputs).logits[0].double().log_softmax(-1)
    bf16_kernels_off(monkeypatch)
    eng = engine(q.path)
    try:
        lp, _ = run(eng, ids, pixels)
    finally:
        eng.shutdown()
    assert kld(ref[:-1], lp).max() <= 1e-5


def test_build_refuses_vision_language_models_and_image_calibration_text_models_in_one_line(vlm, tmp_path):
    from llmq.models import resolve_model
    from llmq.pipeline.kv_options import KVOptions
    from llmq.pipeline.kvcache import _check
    from llmq.pipeline.targets.stage import BuildOptions, build_engine

    art = vlm[1]
    store = Store(art.path.parent.parent)
    for target in ("llmq", "trtllm"):
        with pytest.raises(LlmqError, match="does not write this vision-language model yet"):
            build_engine(art, store, BuildOptions(target=target))
    text_model = resolve_model(str(make_tiny_model(tmp_path / "text", seed=1)), store)
    with pytest.raises(LlmqError, match="--image-share: .* takes no images"):
        _check(text_model, KVOptions(kv="int8", image_share=0.5))


def test_image_questions_are_drawn_from_their_seed_with_checkable_answers():
    from llmq import image_questions as iq

    qs = iq.image_questions(10, seed=3)
    assert [q.kind for q in qs] == list(iq.KINDS) * 2
    again = iq.image_questions(10, seed=3)
    assert all(a.image.tobytes() == b.image.tobytes() and a.answer == b.answer for a, b in zip(qs, again))
    assert any(a.image.tobytes() != b.image.tobytes() for a, b in zip(qs, iq.image_questions(10, seed=4)))
    for q in qs:
        assert q.image.size == (iq.SIZE, iq.SIZE)
        assert len(set(q.image.getdata())) > 1   # something drawn, not a blank
    colour = next(q for q in qs if q.kind == "colour")   # the fill is the named colour
    assert max(colour.image.getcolors(), key=lambda c: c[0])[1] == iq.COLOURS[colour.answer]
    chart = next(q for q in qs if q.kind == "chart")
    assert chart.answer in "ABCDE"


def test_kv_calibration_of_a_vision_language_model_sees_its_image_tokens(vlm, tmp_path):
    """quantize-kv on the tiny Gemma 3 VLM with --image-share 0.75: six of the eight calibration samples are generated
    image + question conversations, prefilled with their pixels; the per-head scales are the absolute maxima of the K
    / V that transformers computes on the same samples (images included: with blank pixels they differ), and the
    manifest records the image share."""
    from transformers import DynamicCache, Gemma3ForConditionalGeneration

    from llmq.models.load import load_tokenizer
    from llmq.pipeline.kv_options import KVOptions
    from llmq.pipeline.kvcache import quantize_kv
    from llmq.pipeline.quantize.calib import load_calibration
    from llmq.pipeline.quantize.calib_images import with_images

    art = vlm[1]
    store = Store(art.path.parent.parent)
    q = quantize_kv(art, store, KVOptions(kv="int8", granularity="head", num_samples=8, seq_len=8, probe_tokens=64,
                                          image_share=0.75, name="vlm-kv"), show_progress=False)
    record = q.config["calibration"]["image_conversations"]
    assert record["images"] == 6
    assert record["share"] == 0.75
    tok = load_tokenizer(art.path)
    calib = with_images(load_calibration(None, tok, 8, 8, seed=0), art.path, tok, 6)
    texts, images = [w.tolist() for w in calib.samples], list(calib.images)
    image_token = tok.convert_tokens_to_ids("<image_soft_token>")
    assert all(ids.count(image_token) == 4 for ids, _ in images)
    hf = Gemma3ForConditionalGeneration.from_pretrained(vlm[0], dtype=torch.float32).eval()

    def amax(samples):
        top = None
        with torch.no_grad():
            for ids, pixels in samples:
                ids_t = torch.tensor([ids])
                extra = {} if pixels is None else {"pixel_values": pixels,
                                                   "token_type_ids": (ids_t == image_token).long()}
                cache = hf(input_ids=ids_t, past_key_values=DynamicCache(), **extra).past_key_values   # (whole:
                # no sliding-window layer that keeps only the last tokens)
                m = torch.stack([torch.stack([layer.keys[0].abs().amax((1, 2)), layer.values[0].abs().amax((1, 2))])
                                 for layer in cache.layers])   # [layers, K / V, heads]
                top = m if top is None else torch.maximum(top, m)
        return top

    want = amax([(t, None) for t in texts] + images)
    from safetensors import safe_open

    got = torch.zeros_like(want)
    for f in q.path.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                if k.endswith(("k_scale", "v_scale")):
                    layer = int(k.split("layers.")[1].split(".")[0])
                    got[layer, int(k.endswith("v_scale"))] = h.get_tensor(k).float().flatten() * 127
    assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max())
    # the images moved the scales: without their pixels (blank ones) the maxima differ
    blank = amax([(t, None) for t in texts] + [(ids, torch.zeros_like(p)) for ids, p in images])
    assert float((blank - want).abs().max()) > 1e-3 * float(want.abs().max())


def test_weight_calibration_streams_image_conversations_as_the_model_computes_them(vlm):
    """The layer-by-layer pass's image windows: each generated conversation's layer inputs (the projected image
    features in place of its image tokens, an image's tokens attending to each other both ways) run through the
    streamed float layers equal transformers' hidden states layer by layer; and GPTQ calibrated on them records the
    image share."""
    from transformers import Gemma3ForConditionalGeneration

    from llmq.models import ModelSpec
    from llmq.models.load import load_tokenizer
    from llmq.pipeline.quantize import QuantizeOptions, quantize
    from llmq.pipeline.quantize.calib import load_calibration
    from llmq.pipeline.quantize.calib_images import image_windows, with_images
    from llmq.pipeline.quantize.streamed import capture_layer0, load, skeleton, source_tensors

    src, art = vlm
    tok = load_tokenizer(art.path)
    calib = with_images(load_calibration(None, tok, 4, 24, seed=0), art.path, tok, 2)
    assert len(calib.samples) == 2
    assert len(calib.images) == 2
    spec = ModelSpec.from_config(art.path)
    arch, device = spec.arch, torch.device("cpu")
    source = source_tensors(art.path, spec)
    model = skeleton(art.path, arch, torch.float32, device)
    load(model.get_submodule("model.embed_tokens"), "model.embed_tokens", source, device)
    hidden, kws = capture_layer0(model, arch, calib.samples, device, None,
                                 image_windows(art.path, model, list(calib.images), device))
    hf = Gemma3ForConditionalGeneration.from_pretrained(src, dtype=torch.float32).eval()
    image_token = tok.convert_tokens_to_ids("<image_soft_token>")
    layers = model.get_submodule(arch.layers)
    with torch.no_grad():
        for w, (ids, pixels) in enumerate(calib.images):
            ids_t = torch.tensor([ids])
            want = hf(input_ids=ids_t, pixel_values=pixels, token_type_ids=(ids_t == image_token).long(),
                      output_hidden_states=True).hidden_states
            x = hidden[len(calib.samples) + w]
            for i in range(len(layers)):
                assert float((x - want[i]).abs().max()) <= 1e-4 * float(want[i].abs().max()), (w, i)
                x = load(layers[i], arch.prefix(i), source, device)(x, **kws[i][len(calib.samples) + w])
    q = quantize(art, QuantizeOptions(method="gptq", bits=4, group_size=16, num_samples=4, seq_len=24,
                                      image_share=0.5, probe_tokens=0, name="vlm-gptq-images"),
                 Store(art.path.parent.parent), progress=False)
    record = q.config["calibration"]["image_conversations"]
    assert record["images"] == 2
    assert record["share"] == 0.5
    assert q.config["vision"]["calibration"].startswith("2 image conversations")


def test_gguf_build_writes_the_tower_as_llamacpp_mmproj(vlm):
    """build --target gguf on the tiny Gemma 3 VLM: the language model's GGUF and an mmproj GGUF of the tower (clip,
    projector gemma3) with llama.cpp's converter's keys, names and types (checked tensor for tensor against
    `convert_hf_to_gguf.py --mmproj` of the same model, and run by llama-server beside the language model's file:
    benchmarks/vlm_gguf_in_llamacpp.py), its values the checkpoint's: matrices in float16, the projector's norm as
    1 + w."""
    import gguf
    import numpy as np

    from llmq.models.reader import CheckpointReader
    from llmq.pipeline.targets.stage import BuildOptions, build_engine

    src, art = vlm
    e = build_engine(art, Store(art.path.parent.parent), BuildOptions(target="gguf", probe_tokens=0, name="vlm-gguf"))
    record = json.loads((e.path / "engine.json").read_text())["outputs"]["gguf"]
    assert (e.path / record["file"]).is_file()
    r = gguf.GGUFReader(e.path / record["mmproj"]["file"])
    fields = {f.name: f.contents() for f in r.fields.values() if not f.name.startswith("GGUF.")}
    cfg = json.loads((src / "config.json").read_text())
    vc = cfg["vision_config"]
    assert (fields["general.architecture"], fields["general.type"], fields["clip.projector_type"]) == (
        "clip", "mmproj", "gemma3")
    assert fields["clip.has_vision_encoder"] is True
    assert (fields["clip.vision.image_size"], fields["clip.vision.patch_size"], fields["clip.vision.block_count"],
            fields["clip.vision.embedding_length"], fields["clip.vision.projection_dim"]) == (
        vc["image_size"], vc["patch_size"], vc["num_hidden_layers"], vc["hidden_size"],
        cfg["text_config"]["hidden_size"])
    assert fields["clip.vision.image_mean"] == [0.5, 0.5, 0.5]
    tower = CheckpointReader(art.path).tensors
    tensors = {t.name: t for t in r.tensors}
    assert len(tensors) == len(tower.vision)
    want = {"v.blk.1.attn_q.weight": ("vision_tower.encoder.layers.1.self_attn.q_proj.weight", "F16"),
            "v.blk.0.ffn_down.bias": ("vision_tower.encoder.layers.0.mlp.fc2.bias", "F32"),
            "v.patch_embd.weight": ("vision_tower.embeddings.patch_embedding.weight", "F32"),
            "v.position_embd.weight": ("vision_tower.embeddings.position_embedding.weight", "F32"),
            "mm.input_projection.weight": ("multi_modal_projector.mm_input_projection_weight", "F16"),
            "mm.soft_emb_norm.weight": ("multi_modal_projector.mm_soft_emb_norm.weight", "F32")}
    for name, (stored, kind) in want.items():
        t = tensors[name]
        assert t.tensor_type.name == kind
        value = tower.vision_tensor(stored).float().numpy() + (1 if "soft_emb_norm" in name else 0)
        assert np.array_equal(np.asarray(t.data).reshape(value.shape),
                              value.astype(np.float16 if kind == "F16" else np.float32)), name


def test_images_task_scores_answers_in_process_and_through_an_endpoint_alike(vlm, tmp_path):
    """`--tasks images` on the tiny Gemma 3 VLM: questions about generated images, greedy answers scored by their
    first word or number; llmq's runtime and the same model behind `llmq serve` (chat completions with `data:` PNG
    URLs) answer every item alike. Right answers score 100, wrong ones 0; a text-only model and the transformers
    backend are refused in one line."""
    from helpers import live_server

    from llmq import image_questions
    from llmq.evals.chat import image_answer, run_chat_tasks
    from llmq.evals.evaluate import Served, _endpoint_lm
    from llmq.evals.lm import HFLM, Generation, LlmqLM
    from llmq.evals.runner import EvalSettings
    from llmq.evals.tasks import materialize
    from llmq.models import resolve_model
    from llmq.runtime import EngineConfig

    assert (image_answer(" 7.\n"), image_answer("Red, I think"), image_answer("...")) == ("7", "red", "")
    src, art = vlm
    store = Store(art.path.parent.parent)
    ts = materialize(tmp_path / "tasks", seed=0)
    cfg = EngineConfig(max_num_seqs=8, kv_cache_memory=8 << 20, max_model_len=160)
    ours = LlmqLM(art.path, engine_config=cfg)
    try:
        mine = []
        score = run_chat_tasks(ours, ts, ["llmq_images"], 10, mine)["llmq_images"]
        assert score["n"] == 10
        assert {r["row"]["kind"] for r in mine} == set(image_questions.KINDS)
        questions = image_questions.image_questions(10, 0)
        for answers, want in (([f" {q.answer}." for q in questions], 100.0), (["?"] * 10, 0.0)):
            ours.generate_images = lambda items, n, a=answers: [Generation(t, True) for t in a]
            assert run_chat_tasks(ours, ts, ["llmq_images"], 10)["llmq_images"]["value"] == want
    finally:
        ours.close()
    with live_server(art.path, cfg, name="vlm") as live:
        served = Served.connect(live.url, None, None, 30.0, store)
        theirs = []
        lm = _endpoint_lm(store, EvalSettings(tasks=["images"]), served, lambda todo, done: None, None)
        assert run_chat_tasks(lm, ts, ["llmq_images"], 10, theirs)["llmq_images"]["value"] == score["value"]
    assert [r["text"] for r in theirs] == [r["text"] for r in mine]
    assert len({r["text"] for r in mine}) > 1   # answers that depend on the image
    with pytest.raises(LlmqError, match="not the HFLM backend"):
        HFLM.generate_images(object.__new__(HFLM), [], 8)
    text_model = resolve_model(str(make_tiny_model(tmp_path / "text", seed=1)), store)
    plain = LlmqLM(text_model.path, engine_config=cfg)
    try:
        with pytest.raises(LlmqError, match="takes none"):
            plain.generate_images([([], "", None)], 8)
    finally:
        plain.close()


def test_vision_recipe_runs_end_to_end_on_a_tiny_model(vlm, tmp_path, monkeypatch):
    """recipes/gemma3-vision.yaml with its model swapped for the tiny Gemma 3 VLM (and small sample counts): GPTQ
    calibrated on image conversations, an INT8 KV cache whose scales saw image tokens, eval of images and KLD with
    gates against the 16-bit model."""
    import yaml

    from llmq.pipeline.recipe import load_recipe
    from llmq.pipeline.runner import run_recipe

    monkeypatch.setenv("LLMQ_CACHE", str(tmp_path / "cache"))
    src, _ = vlm
    recipe = yaml.safe_load((ROOT / "recipes" / "gemma3-vision.yaml").read_text())
    recipe["model"] = str(src)
    recipe["stages"]["quantize"] |= {"group_size": 16, "num_samples": 4, "seq_len": 24, "probe_tokens": 64}
    recipe["stages"]["quantize-kv"] |= {"num_samples": 4, "seq_len": 24, "probe_tokens": 64}
    recipe["stages"]["eval"] |= {"limit": 5, "gate": "images>=-100,kld<=10"}
    path = tmp_path / "vision.yaml"
    path.write_text(yaml.safe_dump(recipe))
    result = run_recipe(load_recipe(path), Store(tmp_path / "store"))
    assert [r.status for r in result.stages] == ["ran"] * 3
    assert not result.failed_gates
    q, kv, report = (r.artifact for r in result.stages)
    assert q.config["calibration"]["image_conversations"]["images"] == 1
    assert kv.config["calibration"]["image_conversations"]["images"] == 1
    assert "llmq_images" in json.dumps(report.manifest)


def test_prompt_logprobs_take_images_and_kld_reads_image_conditioned_text(vlm, prompt, reference, tmp_path,
                                                                          monkeypatch):
    """The runtime's prompt log-probabilities with the images in place, in chunks that never end inside an image,
    equal transformers'; eval's kld adds the KL on the text after generated images (kld.images): zero against
    itself, above zero for an INT4 artifact against its model."""
    from llmq.evals.evaluate import run_eval
    from llmq.evals.runner import EvalSettings
    from llmq.pipeline.quantize import QuantizeOptions, quantize

    _, art = vlm
    _, _, ids, pixels = prompt
    ref, _ = reference
    eng = engine(art.path, max_num_batched_tokens=8)
    try:
        lp = eng.prompt_logprobs(ids, pixels).double()
    finally:
        eng.shutdown()
    assert kld(ref, lp).max() <= 1e-5
    monkeypatch.setenv("LLMQ_CACHE", str(tmp_path / "cache"))
    store = Store(art.path.parent.parent)
    same = run_eval(store, art, art, EvalSettings(tasks=["kld"], limit=3), []).report["kld"]["images"]
    assert same["conversations"] == 3
    assert same["tokens"] > 0
    assert same["mean"] == 0.0
    q = quantize(art, QuantizeOptions(method="rtn", bits=4, group_size=16, probe_tokens=0, name="vlm-rtn-kld"), store,
                 progress=False)
    assert run_eval(store, q, art, EvalSettings(tasks=["kld"], limit=3), []).report["kld"]["images"]["mean"] > 1e-4
