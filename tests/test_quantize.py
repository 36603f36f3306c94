"""`llmq quantize`: RTN against a hand reference, GPTQ / AWQ against RTN on the same data, exact AWQ folding, bad input
refused before any work, deterministic artifacts, the format read back without transformers, and the runtime
computing what the quantizer optimised. Integration tests check issue 3's bars on the default model."""

import json
import math
import sys
import time

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers import bf16_kernels_off

from llmq.cli.main import cli
from llmq.errors import LlmqError
from llmq.models import qformat, resolve_model
from llmq.models.arch import ARCHS
from llmq.models.checkpoint import load_state_dict, read_config
from llmq.pipeline.quantize import QuantizeOptions, awq, calib, gptq, quantize, rtn
from llmq.pipeline.quantize.probe import kld_top1

FAST = dict(num_samples=4, seq_len=64, probe_tokens=256)


def _hand_rtn(w: np.ndarray, bits: int, group: int, symmetric: bool):
    """Plain loops over rows and groups, scales rounded to bf16 the way the checkpoint stores them."""
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    n, k = w.shape
    g = group or k
    q = np.zeros((n, k), np.int64)
    scales = np.zeros((n, k // g), np.float32)
    zeros = np.zeros((n, k // g), np.int64)
    def bf16(v):  # the smallest bfloat16 >= v: bfloat16 keeps 8 significant bits
        b = float(torch.tensor(float(v)).to(torch.bfloat16))
        return b + 2.0 ** (math.frexp(b)[1] - 8) if b < float(v) else b

    for r in range(n):
        for j in range(k // g):
            blk = w[r, j * g:(j + 1) * g]
            if symmetric:
                s, z = bf16(np.float32(np.abs(blk).max()) / np.float32(qmax)), 0
            else:
                lo, hi = np.float32(min(blk.min(), 0)), np.float32(max(blk.max(), 0))
                s = bf16((hi - lo) / np.float32(qmax - qmin))
                z = int(np.clip(np.round(np.float32(qmin) - lo / np.float32(s)), qmin, qmax))
            scales[r, j], zeros[r, j] = s, z
            q[r, j * g:(j + 1) * g] = np.clip(np.round(blk / np.float32(s)) + z, qmin, qmax)
    return q, scales, zeros


@pytest.mark.parametrize("bits,group,symmetric", [(4, 16, True), (4, 16, False), (8, 0, True), (8, 0, False),
                                                  (4, 0, False), (8, 32, True), (5, 32, True), (5, 32, False)])
def test_rtn_matches_hand_reference(bits, group, symmetric):
    gen = torch.Generator().manual_seed(bits * 100 + group + symmetric)
    w = torch.randn(24, 64, generator=gen) * 0.05
    w[:, 3] += 0.3  # an offset column: asymmetric grids differ from symmetric ones
    qw = rtn.quantize_weight(w, bits, group, symmetric, torch.bfloat16)
    q, s, z = _hand_rtn(w.numpy(), bits, group, symmetric)
    assert qw.q.dtype == torch.int8
    assert np.array_equal(qw.q.numpy().astype(np.int64), q)
    assert qw.scale.dtype == torch.bfloat16
    assert np.array_equal(qw.scale.float().numpy(), s)
    assert (qw.zero_point is None) == symmetric
    if not symmetric:
        assert np.array_equal(qw.zero_point.numpy().astype(np.int64), z)
    assert qw.scheme == f"W{bits}A16-{f'group{group}' if group else 'channel'}-{'sym' if symmetric else 'asym'}"
    # every weight within half a step of its grid point: scales rounded up never clip
    err = (qw.dequantize() - w).abs().view(24, -1, group or 64)
    assert bool((err <= qw.scale.float().view(24, -1, 1) * 0.5 + 1e-7).all())


def _group_errors(w: torch.Tensor, qw, group: int, importance: torch.Tensor | None = None) -> torch.Tensor:
    """Per-group squared rounding error of qw against w, in float64 (weighted per input column if importance)."""
    e = (qw.dequantize(torch.float64) - w.double()).pow(2)
    if importance is not None:
        e = e * importance.double()
    return e.view(w.shape[0], -1, group).sum(-1)


def _brute_force_errors(w: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """The least per-group squared error over 2,000 signed scales +-amax / t, t = qmax - 1.5 .. 16 (float64, symmetric
    grid): what an exhaustive search finds."""
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    wg = w.double().view(w.shape[0], -1, group)
    amax = wg.abs().amax(-1, keepdim=True)
    best = torch.full(amax.shape, float("inf"), dtype=torch.float64)
    for f in torch.linspace(1 / (qmax - 1.5), 1 / 16, 1000, dtype=torch.float64):
        for sign in (1, -1):
            s = sign * amax * f
            q = torch.round(wg / s).clamp(qmin, qmax)
            best = torch.minimum(best, (q * s - wg).pow(2).sum(-1, keepdim=True))
    return best[..., 0]


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 16), (5, 32), (8, 32)])
def test_searched_scales_use_the_whole_signed_grid_and_never_lose_to_amax(bits, group):
    w = torch.randn(64, 128) * 0.05  # fresh weights every run
    w[torch.rand(w.shape) < 0.01] *= 6  # heavy tails, as in LLM weights
    amax = rtn.quantize_weight(w, bits, group, True, torch.float32)
    searched = rtn.quantize_weight(w, bits, group, True, torch.float32, search=True)
    e_amax, e_search = _group_errors(w, amax, group), _group_errors(w, searched, group)
    # amax's grid is a candidate and refitting never hurts, up to what float32 resolves of the residuals the search
    # compares: at 8 bits a group's error is ~1e-5 of its weights' energy, so ties are decided within ~1e-5 of it
    assert bool((e_search <= e_amax * (1 + (1e-6 if bits == 4 else 1e-4))).all())
    assert float(e_search.sum()) < 0.9 * float(e_amax.sum())
    assert int(searched.q.min()) == -(1 << (bits - 1))
    assert bool((searched.scale < 0).any())  # both ends of the grid
    # stored in bf16, the integers are the nearest ones for the stored scale
    b = rtn.quantize_weight(w, bits, group, True, torch.bfloat16, search=True)
    s = b.scale.float().repeat_interleave(group, -1)
    assert torch.equal(b.q.float(), torch.round(w / s).clamp(-(1 << (bits - 1)), (1 << (bits - 1)) - 1))


@pytest.mark.parametrize("group", [32, 16])
def test_searched_4bit_scales_come_within_3_percent_of_an_exhaustive_search(group):
    w = torch.randn(64, 128) * 0.05
    w[torch.rand(w.shape) < 0.01] *= 6
    e_best = float(_brute_force_errors(w, 4, group).sum())
    searched = rtn.quantize_weight(w, 4, group, True, torch.float32, search=True)
    amax = rtn.quantize_weight(w, 4, group, True, torch.float32)
    assert float(_group_errors(w, searched, group).sum()) <= 1.03 * e_best
    assert float(_group_errors(w, amax, group).sum()) > 1.2 * e_best  # what the amax rule misses


def test_searched_scales_follow_the_importance_they_are_given():
    w = torch.randn(48, 64) * 0.05
    imp = torch.rand(64) ** 4 * 100  # a few columns matter far more than the rest
    plain = rtn.quantize_weight(w, 4, 32, True, torch.float32, search=True)
    weighted = rtn.quantize_weight(w, 4, 32, True, torch.float32, search=True, importance=imp)
    assert float(_group_errors(w, weighted, 32, imp).sum()) < 0.95 * float(_group_errors(w, plain, 32, imp).sum())
    assert float(_group_errors(w, weighted, 32).sum()) > float(_group_errors(w, plain, 32).sum())


@pytest.mark.parametrize("group", [16, 0])
def test_searched_asymmetric_scales_never_lose_to_amax(group):
    w = torch.randn(32, 64) * 0.05 + 0.02
    w[torch.rand(w.shape) < 0.02] *= 8
    amax = rtn.quantize_weight(w, 4, group, False, torch.bfloat16)
    searched = rtn.quantize_weight(w, 4, group, False, torch.bfloat16, search=True)
    e_amax, e_search = _group_errors(w, amax, group or 64), _group_errors(w, searched, group or 64)
    assert bool((e_search <= e_amax).all())
    assert float(e_search.sum()) < 0.97 * float(e_amax.sum())


def _correlated_inputs(gen, t, k):
    mix = torch.randn(k, k, generator=gen) / k ** 0.5 + torch.eye(k)
    x = torch.randn(t, k, generator=gen) @ mix
    x[:, :4] *= 8.0  # a few high-energy channels, as in LLM activations
    return x


@pytest.mark.parametrize("group,symmetric,act_order,bits", [(0, True, False, 4), (16, True, False, 4),
                                                            (16, False, True, 4), (0, False, True, 4),
                                                            (32, True, True, 5), (32, False, False, 5)])
def test_gptq_cuts_layer_output_error_vs_rtn(group, symmetric, act_order, bits):
    gen = torch.Generator().manual_seed(7 + group)
    x, w = _correlated_inputs(gen, 1024, 64), torch.randn(48, 64, generator=gen) * 0.1
    h = 2 * x.T @ x / x.shape[0]
    ref = x.double() @ w.double().T
    err = lambda qw: float((x.double() @ qw.dequantize(torch.float64).T - ref).pow(2).sum())  # noqa: E731
    g = gptq.gptq_quantize(w, h, bits, group, symmetric, torch.bfloat16, damp=0.01, act_order=act_order)
    r = rtn.quantize_weight(w, bits, group, symmetric, torch.bfloat16)
    assert err(g) < 0.75 * err(r)
    half = 1 << (bits - 1)
    assert g.q.shape == w.shape
    assert int(g.q.min()) >= -half
    assert int(g.q.max()) <= half - 1
    assert g.scale.shape == r.scale.shape
    assert (g.zero_point is None) == symmetric


# bars: above the largest ratio of 30 blocks of 8 draws (seeds 0-239: 0.56, 0.69, 0.68, 0.88); one draw alone varies
# too much (asymmetric act-order: 0.83 median, 1.08 worst of 300), so the errors of 8 draws are summed
@pytest.mark.parametrize("group,symmetric,act_order,bar", [(16, True, False, 0.65), (16, True, True, 0.75),
                                                           (0, True, False, 0.75), (16, False, True, 0.93)])
def test_gptq_with_searched_scales_cuts_output_error_vs_amax_scales(group, symmetric, act_order, bar):
    amax = searched = 0.0
    for seed in range(8):
        gen = torch.Generator().manual_seed(seed)
        x, w = _correlated_inputs(gen, 1024, 64), torch.randn(48, 64, generator=gen) * 0.1
        h = 2 * x.T @ x / x.shape[0]
        ref = x.double() @ w.double().T
        err = lambda qw: float((x.double() @ qw.dequantize(torch.float64).T - ref).pow(2).sum())  # noqa: E731
        amax += err(gptq.gptq_quantize(w, h, 4, group, symmetric, torch.bfloat16, act_order=act_order))
        searched += err(gptq.gptq_quantize(w, h, 4, group, symmetric, torch.bfloat16, act_order=act_order,
                                           search=True))
    assert searched < bar * amax


def test_gptq_act_order_keeps_group_scales_in_original_column_order():
    gen = torch.Generator().manual_seed(3)
    x, w = _correlated_inputs(gen, 512, 64), torch.randn(32, 64, generator=gen) * 0.1
    x[:, 40:] *= 5.0  # the most important columns are the last ones: act-order really permutes
    h = 2 * x.T @ x / x.shape[0]
    a = gptq.gptq_quantize(w, h, 4, 16, True, torch.bfloat16, act_order=True)
    b = gptq.gptq_quantize(w, h, 4, 16, True, torch.bfloat16, act_order=False)
    static = rtn.quantize_weight(w, 4, 16, True, torch.bfloat16)
    assert torch.equal(a.scale, static.scale)  # group c // 16 of the original weight, no g_idx needed
    assert not torch.equal(a.q, b.q)
    # the stored tensors describe exactly the weight GPTQ optimised: columns dequantize with their own group's scale
    deq = (a.q.float().view(32, 4, 16) * a.scale.float().view(32, 4, 1)).view(32, 64)
    assert torch.equal(deq, a.dequantize())


def test_gptq_zeroes_columns_that_never_see_input():
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(256, 32, generator=gen), torch.randn(16, 32, generator=gen)
    x[:, 5] = 0
    qw = gptq.gptq_quantize(w, 2 * x.T @ x / 256, 8, 0, True, torch.float32)
    assert bool((qw.q[:, 5] == 0).all())


@pytest.mark.parametrize("heads,kv_heads,model_type", [(4, 2, "llama"), (6, 2, "qwen2"), (4, 4, "llama"),
                                                       (6, 2, "qwen3"), (4, 2, "gemma3_text"), (6, 2, "phi3")])
def test_awq_folding_leaves_the_float_model_unchanged(tmp_path, make_tiny_model, heads, kv_heads, model_type):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path / "m", seed=1, num_attention_heads=heads, num_key_value_heads=kv_heads,
                           hidden_size=16 * heads, model_type=model_type)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    ids = torch.randint(0, 320, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
        gen = torch.Generator().manual_seed(9)
        for layer in model.model.layers:
            for producer, _, consumers in ARCHS[model_type].feed_paths():
                k = layer.get_submodule(consumers[0]).in_features
                s = torch.rand(k, generator=gen, dtype=torch.float64) * 4 + 0.25
                if producer == ARCHS[model_type].path("v_proj"):
                    s = awq.tie_heads(s, heads, kv_heads)
                awq.fold_scales(layer, producer, consumers, s, heads, kv_heads, ARCHS[model_type].norm_offset)
        after = model(ids).logits
    assert not torch.equal(model.model.layers[0].input_layernorm.weight, torch.ones_like(before[0, 0, :16 * heads]))
    # transformers' Gemma norm forms (1 + w) in float32 even in a float64 model (5.7e-7 measured; a fold that
    # ignored the offset is off by 2.5)
    tol = 1e-5 if ARCHS[model_type].norm_offset else 1e-10
    torch.testing.assert_close(after, before, rtol=tol, atol=tol)


def test_awq_search_beats_rtn_when_channels_have_outliers():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(512, 64, generator=gen)
    x[:, [2, 9, 30]] *= 25.0
    weights = [torch.randn(32, 64, generator=gen) * 0.05, torch.randn(16, 64, generator=gen) * 0.05]
    x_mean = x.abs().mean(0)
    s, alpha, best = awq.search_scales(x, x_mean, weights, 4, 16, True, torch.bfloat16)
    refs = [x @ w.T for w in weights]
    plain = awq.output_error(x, weights, torch.ones(64), 4, 16, True, torch.bfloat16, refs)
    assert alpha > 0
    assert best < 0.8 * plain
    assert abs(float(s.max() * s.min()) - 1) < 1e-4


def test_kld_top1_against_direct_formula():
    gen = torch.Generator().manual_seed(0)
    p, q = torch.randn(5, 7, 50, generator=gen), torch.randn(5, 7, 50, generator=gen)
    out = kld_top1(p, q)
    lp, lq = p.double().log_softmax(-1), q.double().log_softmax(-1)
    want = torch.nn.functional.kl_div(lq, lp, log_target=True, reduction="none").sum(-1).mean()
    assert out["tokens"] == 35
    assert abs(out["kld_mean"] - float(want)) < 1e-12
    assert out["top1"] == float((p.argmax(-1) == q.argmax(-1)).double().mean())
    assert kld_top1(p, p) == {"kld_mean": 0.0, "top1": 1.0, "tokens": 35}


# -- calibration data ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok():
    from helpers import byte_tokenizer

    return byte_tokenizer()


def test_calibration_sources(tmp_path, tok):
    (tmp_path / "a.txt").write_text("alpha beta gamma " * 40)
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"text": f"row {i} " * 20}) for i in range(5)))
    d = calib.load_calibration(str(tmp_path), tok, num_samples=6, seq_len=32, seed=1)
    assert d.source.startswith("dir:")
    assert len(d.samples) == 6
    assert all(len(s) == 32 for s in d.samples)
    assert [s.tolist() for s in d.samples] == [s.tolist() for s in calib.load_calibration(
        str(tmp_path), tok, 6, 32, seed=1).samples]
    assert [s.tolist() for s in d.samples] != [s.tolist() for s in calib.load_calibration(
        str(tmp_path), tok, 6, 32, seed=2).samples]
    one = calib.load_calibration(str(tmp_path / "a.txt"), tok, 1000, 32, 0)
    assert one.manifest()["samples"] == len(one.samples) == (len("alpha beta gamma " * 40)) // 32
    default = calib.load_calibration(None, tok, 8, 128, 0)
    assert default.source.startswith("bundled:calib_en.txt+calib_chat.jsonl+stdlib:")
    assert default.tokens == 8 * 128
    probe = calib.load_probe_text(tok, 1024)
    assert probe.tokens == 1024
    assert "probe_en.txt" in probe.source


@pytest.mark.parametrize("content,match", [("", "empty"), ("   \n\n", "empty"), ('{"txt": "x"}\n', "text")])
def test_bad_calibration_files(tmp_path, tok, content, match):
    f = tmp_path / ("c.jsonl" if "{" in content else "c.txt")
    f.write_text(content)
    with pytest.raises(LlmqError, match=match):
        calib.load_calibration(str(f), tok, 4, 32, 0)


# Qwen3's <think> block on the last assistant turn, its reasoning only when thinking is on; SmolLM3's mode flag
THINKING_TEMPLATE = (
    "{% if enable_thinking is defined and not enable_thinking %}/no_think\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' and loop.last %}<think>"
    "{% if enable_thinking is not defined or enable_thinking %}{{ m.reasoning_content or '' }}{% endif %}</think>"
    "{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}")
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"},
                {"role": "assistant", "content": "4", "reasoning_content": "two and two make four"}]


def _thinking_tok():
    from helpers import byte_tokenizer

    t = byte_tokenizer()
    t.chat_template = THINKING_TEMPLATE
    return t


def _texts(w: calib.TokenWindows, tok, domain: str) -> list[str]:
    return [tok.decode(s) for s, d in zip(w.samples, w.domains) if d == domain]


def test_default_calibration_mixes_chat_through_the_template_with_prose_and_code(tok):
    import hashlib

    from helpers import CHATML

    bundled = (calib.DATA / calib.CALIB_CHAT).read_text().splitlines()
    w = calib.load_calibration(None, tok, 16, 512, 0)   # byte tokens: a conversation is 300 to 1400 of them
    m = w.manifest()
    assert m["chat"] == {"conversations": len(bundled), "chat_template": True, "thinking": None,
                         "template_sha256": hashlib.sha256(CHATML.encode()).hexdigest()}
    assert m["domains"] == {"chat": 8 * 512, "code": 4 * 512, "prose": 4 * 512}   # 2 : 1 : 1
    assert w.domains[:4] == ("chat", "prose", "code", "chat")   # interleaved, so a prefix keeps the mix
    chat = _texts(w, tok, "chat")
    assert all("<|im_start|>" in t for t in chat)
    assert sum(t.startswith("<|im_start|>") for t in chat) >= 6  # of 8
    assert not any("<|im_start|>" in t for t in _texts(w, tok, "code") + _texts(w, tok, "prose"))
    again = calib.load_calibration(None, tok, 16, 512, 0)
    assert [s.tolist() for s in again.samples] == [s.tolist() for s in w.samples]
    assert again.manifest() == m
    assert [s.tolist() for s in calib.load_calibration(None, tok, 16, 512, 1).samples] != [
        s.tolist() for s in w.samples]
    plain = calib.load_calibration(None, tok, 16, 512, 0, chat_template=False)
    assert plain.manifest()["chat"] | {"conversations": 0} == {"conversations": 0, "chat_template": False,
                                                                "template_sha256": None, "thinking": None}
    assert plain.sha256 != w.sha256
    assert not any("<|im_start|>" in t for t in _texts(plain, tok, "chat"))
    assert any("\nassistant: " in t for t in _texts(plain, tok, "chat"))


# Hermes-style tools: the functions in a system turn, calls as <tool_call> JSON (Qwen's templates, shortened)
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools><|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>"
    "{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}")


def test_tool_call_conversations_calibrate_where_the_template_renders_tools(tmp_path, tok):
    from helpers import byte_tokenizer

    tools_tok = byte_tokenizer()
    tools_tok.chat_template = TOOLS_TEMPLATE
    w = calib.load_calibration(None, tools_tok, 20, 512, 0)
    assert calib.CALIB_TOOLS in w.source
    assert w.manifest()["domains"]["tools"] == 4 * 512  # 2 : 1 : 1 : 1
    texts = _texts(w, tools_tok, "tools")
    assert texts
    assert all("<tools>" in t or "<tool_call>" in t for t in texts)
    assert any('<tool_call>\n{"name": "' in t for t in texts)
    assert not any("<tool_call>" in t for t in _texts(w, tools_tok, "chat"))
    assert "tools" not in calib.load_calibration(None, tok, 20, 512, 0).manifest()["domains"]  # CHATML: none
    row = {"tools": [{"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}],
           "messages": [{"role": "user", "content": "Time?"},
                        {"role": "assistant", "content": None, "tool_calls": [
                            {"type": "function", "function": {"name": "now", "arguments": {"tz": "UTC"}}}]},
                        {"role": "tool", "content": "12:00"}, {"role": "assistant", "content": "Noon."}]}
    f = tmp_path / "t.jsonl"
    f.write_text(json.dumps(row) + "\n")
    mine = calib.load_calibration(str(f), tools_tok, 1, 4096, 0)
    assert mine.domains == ("tools",)
    assert '<tool_call>\n{"name": "now", "arguments": {"tz": "UTC"}}\n</tool_call>' in tools_tok.decode(mine.samples[0])
    with pytest.raises(LlmqError, match="renders tools"):
        calib.load_calibration(str(f), tok, 1, 4096, 0)
    probe = calib.load_probe_text(tools_tok, 4096)  # held-out tool conversations lead the probe's text
    assert probe.source.startswith(f"bundled:{calib.PROBE_TOOLS}+")
    assert "<tool_call>" in tools_tok.decode(probe.samples[0])
    assert "probe_tools" not in calib.load_probe_text(tok, 1024).source
    f.write_text(json.dumps({"messages": row["messages"]}) + "\n")  # calls without their tools
    with pytest.raises(LlmqError, match="tool_calls"):
        calib.load_calibration(str(f), tools_tok, 1, 4096, 0)


def test_windows_start_where_a_document_starts_inside_the_window_before():
    ids, starts = list(range(30)), [0, 5, 10]   # documents of 5, 5 and 20 tokens
    assert [w[0] for w in calib._cut(ids, starts, 8)] == [0, 5, 10, 18]   # the 20-token one continues at 18
    assert calib._cut(ids, [0], 8) == [ids[0:8], ids[8:16], ids[16:24]]


def test_thinking_on_off_auto_for_a_template_with_the_switch():
    t = _thinking_tok()
    on, off = calib.ChatFormat.of(t, thinking="on"), calib.ChatFormat.of(t, thinking="off")
    assert on.render(t, CONVERSATION) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2 + 2?"
                                          "<|im_end|>\n<|im_start|>assistant\n<think>two and two make four"
                                          "</think>4<|im_end|>\n", True)
    assert off.render(t, CONVERSATION) == ("/no_think\n" + on.render(t, CONVERSATION)[0].replace(
        "two and two make four", ""), False)
    auto = calib.ChatFormat.of(t)
    assert auto.render(t, CONVERSATION)[1] is True
    assert auto.render(t, CONVERSATION[:2])[1] is False
    rows = [json.loads(line)["messages"] for line in (calib.DATA / calib.CALIB_CHAT).read_text().splitlines()]
    reasoning = [m["reasoning_content"][:24] for r in rows for m in r if "reasoning_content" in m]
    runs = {k: calib.load_calibration(None, t, 1000, 512, 0, thinking=k) for k in ("auto", "on", "off")}  # all
    n = len(rows)
    assert 0 < len(reasoning) < n
    assert {k: (r.manifest()["chat"]["thinking_on"], r.manifest()["chat"]["thinking_off"]) for k, r in runs.items()} \
        == {"auto": (len(reasoning), n - len(reasoning)), "on": (n, 0), "off": (0, n)}
    assert all(r.manifest()["chat"]["thinking"] == k for k, r in runs.items())
    assert len({r.sha256 for r in runs.values()}) == 3   # the digest is of the rendered text
    texts = {k: "".join(_texts(r, t, "chat")) for k, r in runs.items()}
    found = {k: sum(x in texts[k] for x in reasoning) for k in runs}   # a few straddle two shuffled windows
    assert found["off"] == 0
    assert found["on"] == found["auto"] >= len(reasoning) - 3
    assert "<think></think>" in texts["auto"]
    assert "<think></think>" in texts["off"]


def test_thinking_is_refused_where_the_template_has_no_switch(tok):
    with pytest.raises(LlmqError, match="--thinking on: the model's chat template has no thinking switch"):
        calib.load_calibration(None, tok, 4, 32, 0, thinking="on")
    bare = _thinking_tok()
    bare.chat_template = None
    with pytest.raises(LlmqError, match="--thinking off: no chat template is applied"):
        calib.load_calibration(None, bare, 4, 32, 0, thinking="off")
    assert calib.load_calibration(None, bare, 4, 32, 0).manifest()["chat"]["chat_template"] is False
    with pytest.raises(LlmqError, match="--thinking on is a chat template setting"):
        QuantizeOptions(bits=4, method="gptq", thinking="on", chat_template=False).check()


def test_jsonl_conversations_are_rendered_through_the_template(tmp_path, tok):
    rows = [{"messages": [{"role": "user", "content": f"question {i} " * 6},
                          {"role": "assistant", "content": f"answer {i} " * 6}]} for i in range(6)]
    f = tmp_path / "chat.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows + [{"text": "plain row " * 30}]))
    w = calib.load_calibration(str(f), tok, 100, 48, 0)
    m = w.manifest()
    assert set(m["domains"]) == {"chat", "text"}
    assert m["chat"]["conversations"] == 6
    chat = "".join(_texts(w, tok, "chat"))
    assert "<|im_start|>user\nquestion 0 " in chat
    assert "<|im_start|>assistant\nanswer" in chat
    assert all("<|im_start|>" not in x for x in _texts(w, tok, "text"))
    f.write_text(json.dumps({"messages": [{"role": "user"}]}))
    with pytest.raises(LlmqError, match="chat.jsonl:1: .*\"messages\""):
        calib.load_calibration(str(f), tok, 4, 32, 0)


def test_a_template_without_system_turns_gets_the_system_prompt_in_the_first_user_turn(tok):
    t = _thinking_tok()
    t.chat_template = ("{% if messages[0].role == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
                       "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    assert calib.ChatFormat.of(t).render(t, CONVERSATION) == ("[user] Be brief.\n\n2 + 2?\n[assistant] 4\n", None)
    t.chat_template = "{{ raise_exception('never') }}"
    with pytest.raises(LlmqError, match="cannot render a calibration conversation \\(never\\); --no-chat-template"):
        calib.ChatFormat.of(t).render(t, CONVERSATION)


HOSTILE_TEMPLATES = [  # issue 54 item 6: each ran for ever, took 6.3 GB, or printed a 1,427-line traceback
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "did not finish within 1 s"),
    ("{{ 'x' * 2000000000 }}", "needed more than 512 MiB"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed too deeply"),
    ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "characters, more than")]


@pytest.mark.parametrize("template,message", HOSTILE_TEMPLATES, ids=["loops", "repeat", "recursion", "output"])
def test_hostile_chat_templates_fail_calibration_in_one_line(monkeypatch, template, message):
    """A template that loops for ever, multiplies a string to gigabytes, recurses or renders past the output bound
    fails calibration in one line (exit 2 from the command line), within the render deadline and its memory."""
    import llmq.models.chat as chat

    monkeypatch.setattr(chat, "RENDER_SECONDS", 1.0)
    t = _thinking_tok()
    t.chat_template = template
    t0 = time.monotonic()
    with pytest.raises(LlmqError, match="cannot render a calibration conversation") as e:
        calib.ChatFormat.of(t).render(t, CONVERSATION)
    assert message in str(e.value)
    assert "\n" not in str(e.value)
    assert e.value.exit_code == 2
    assert time.monotonic() - t0 < 5


def test_dataset_name_offline_is_a_clear_error(tok, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # the hub libraries read those at import, which an earlier test may have done: then they retried the network
    # for ~20 s before failing
    for module, names in (("huggingface_hub.constants", ["HF_HUB_OFFLINE"]),
                          ("datasets.config", ["HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"])):
        if module in sys.modules:
            for name in names:
                monkeypatch.setattr(sys.modules[module], name, True)
    with pytest.raises(LlmqError, match="local .txt/.jsonl"):
        calib.load_calibration("llmq-test/no-such-dataset", tok, 4, 32, 0)


# -- the stage on tiny models ----------------------------------------------------------------------------------------
@pytest.fixture
def tiny_source(store, tiny_model_dir):
    return resolve_model(str(tiny_model_dir), store)


def _quantized(store):
    return store.list(kind="quantized")


@pytest.mark.parametrize("opts,match", [
    (dict(bits=3), "4, 5 or 8"), (dict(bits=4, group_size=48), "does not divide"),
    (dict(bits=8, method="smoothquant", group_size=0), None), (dict(bits=4, method="rtn", act_order=True), "GPTQ"),
    (dict(bits=4, method="gptq", damp=0), "damp"), (dict(bits=4, method="awq", per_tensor=True), "per tensor"),
    (dict(bits=4, method="gptq", per_tensor=True), "not per tensor"),
    (dict(bits=8, method="fp8", scales="amax"), "--scales is the scale rule"),
    (dict(bits=4, int8_group_size=32), "--int8-group-size sets the groups"),
    (dict(bits=4, embedding="int8", int8_group_size=48), "--int8-group-size 48 does not divide"),
    (dict(bits=5, target_bpw=6), "--target-bpw mixes 4-, 8- and 16-bit .* --bits 4")])
def test_bad_options_are_refused_before_any_work(store, tiny_source, opts, match):
    if match is None:  # a method that exists but does not take these bits: refused by its BITS
        opts = dict(opts, bits=4)
        match = "bits|not available"
    with pytest.raises(LlmqError, match=match):
        quantize(tiny_source, QuantizeOptions(**opts), store, progress=False)
    assert _quantized(store) == []
    assert not list(store.root.glob("*/.staging-*"))


def test_empty_calibration_and_already_quantized_sources_are_refused(store, tiny_source, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(LlmqError, match="empty"):
        quantize(tiny_source, QuantizeOptions(bits=4, method="gptq", calib=str(empty)), store, progress=False)
    for uncalibrated in (QuantizeOptions(bits=4, method="rtn", calib=str(empty)),
                         QuantizeOptions(bits=8, method="fp8", calib=str(empty))):  # dynamic FP8 calibrates nothing
        with pytest.raises(LlmqError, match="uses no calibration data; drop --calib"):
            quantize(tiny_source, uncalibrated, store, progress=False)
    assert _quantized(store) == []
    art = quantize(tiny_source, QuantizeOptions(bits=8, **FAST), store, progress=False)
    with pytest.raises(LlmqError, match="already quantized"):
        quantize(art, QuantizeOptions(bits=4), store, progress=False)
    assert len(_quantized(store)) == 1
    res = CliRunner().invoke(cli, ["--store", str(store.root), "quantize", art.ref, "--bits", "4"])
    assert res.exit_code == 2
    assert res.output.count("\n") == 1
    assert "already quantized" in res.output
    res = CliRunner().invoke(cli, ["--store", str(store.root), "quantize", str(tiny_source.path), "--bits", "3"])
    assert res.exit_code == 2
    assert res.output.startswith("error: --bits must be 4, 5 or 8")


def test_the_manifest_records_how_calibration_chats_were_rendered(store, tiny_model_dir):
    import hashlib

    from helpers import CHATML

    cli_args = ["--store", str(store.root), "quantize", str(tiny_model_dir), "--bits", "4", "--method", "gptq"]
    res = CliRunner().invoke(cli, cli_args + ["--thinking", "on"])   # the tiny model's ChatML has no switch
    assert res.exit_code == 2
    assert res.output.count("\n") == 1
    assert "no thinking switch" in res.output
    res = CliRunner().invoke(cli, cli_args[:-1] + ["rtn", "--thinking", "off"])
    assert res.exit_code == 2
    assert "uses no calibration data; drop --thinking" in res.output
    assert _quantized(store) == []
    tok = _thinking_tok()
    tok.save_pretrained(tiny_model_dir)
    src = resolve_model(str(tiny_model_dir), store)
    art = quantize(src, QuantizeOptions(bits=4, method="gptq", thinking="off", **FAST), store, progress=False)
    m, n = art.config["calibration"], len((calib.DATA / calib.CALIB_CHAT).read_text().splitlines())
    assert m["chat"] == {"conversations": n, "chat_template": True, "thinking": "off", "thinking_on": 0,
                         "thinking_off": n, "template_sha256": hashlib.sha256(THINKING_TEMPLATE.encode()).hexdigest()}
    assert m["domains"] == {"chat": 128, "code": 64, "prose": 64}
    assert art.config["options"]["thinking"] == "off"
    assert hashlib.sha256(CHATML.encode()).hexdigest() != m["chat"]["template_sha256"]


def test_same_inputs_give_the_same_content_id(store, tiny_source):
    opts = QuantizeOptions(bits=4, method="gptq", group_size=32, act_order=True, **FAST)
    a = quantize(tiny_source, opts, store, progress=False)
    b = quantize(tiny_source, opts, store, progress=False)
    assert (a.version, b.version) == (1, 2)
    assert a.id == b.id
    c = quantize(tiny_source, QuantizeOptions(bits=4, method="gptq", group_size=32, act_order=True, seed=1,
                                              **{k: v for k, v in FAST.items()}), store, progress=False)
    assert c.id != a.id  # other calibration windows, other weights
    assert a.parents == [tiny_source.id]
    assert a.kind == "quantized"


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq"])
def test_checkpoint_reads_back_through_qformat_without_transformers(store, tiny_source, method):
    art = quantize(tiny_source, QuantizeOptions(bits=4, method=method, symmetric=False, **FAST), store,
                   progress=False)
    cfg = read_config(art.path)
    qc = qformat.parse_quantization_config(cfg)
    assert qc.format == "pack-quantized"
    assert qc.weights.num_bits == 4
    assert qc.weights.group_size == 64
    assert qc.ignore == ("lm_head",)
    assert not qc.weights.symmetric
    tensors = load_state_dict(art.path)
    src = load_state_dict(tiny_source.path)
    linears = [k.removesuffix(".weight") for k in src if k.startswith("model.layers.") and k.endswith("_proj.weight")]
    assert len(linears) == 14
    for name in linears:
        qw = qformat.read_linear(tensors, name, qc)
        assert qw is not None
        assert qw.scale.dtype == src[name + ".weight"].dtype
        rel = (qw.dequantize() - src[name + ".weight"]).norm() / src[name + ".weight"].norm()
        assert 0 < rel < 0.2 or method == "awq"  # AWQ stores W diag(s), its 1/s folded into the producer
    norm = "model.layers.0.input_layernorm.weight"
    assert torch.equal(tensors[norm], src[norm]) == (method != "awq")
    assert torch.equal(tensors["lm_head.weight"], src["lm_head.weight"])
    assert torch.equal(tensors["model.embed_tokens.weight"], src["model.embed_tokens.weight"])
    assert qformat.read_linear(tensors, "lm_head", qc) is None
    assert art.config["calibration" if method != "rtn" else "method"]
    m = art.metrics
    assert m["probe"]["tokens"] == 256
    assert 0 < m["probe"]["kld_mean"]
    assert 0 < m["probe"]["top1"] <= 1
    assert m["peak_rss_bytes"] > 0
    assert m["size_bytes"] < m["source_bytes"]


@pytest.mark.parametrize("bits,symmetric,group", [(8, True, 0), (8, False, 32), (4, False, 16)])
def test_runtime_computes_what_the_quantizer_stored(store, tiny_source, bits, symmetric, group, monkeypatch):
    """The bundled runtime on the artifact vs a float64 forward with the dequantized weights read via qformat, on its
    float32 dequantize path (its bf16-activation kernels are their own tests')."""
    from transformers import AutoModelForCausalLM

    from llmq.runtime import EngineConfig, LLMEngine

    art = quantize(tiny_source, QuantizeOptions(bits=bits, method="gptq", group_size=group, symmetric=symmetric,
                                                **FAST), store, progress=False)
    ref = AutoModelForCausalLM.from_pretrained(tiny_source.path, dtype=torch.float64).eval()
    tensors, qc = load_state_dict(art.path), qformat.parse_quantization_config(read_config(art.path))
    with torch.no_grad():
        for name, mod in ref.named_modules():
            qw = qformat.read_linear(tensors, name, qc)
            if qw is not None:
                mod.weight.copy_(qw.dequantize(torch.float64))
        ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(4))
        want = ref(ids[None]).logits[0].log_softmax(-1)
    bf16_kernels_off(monkeypatch)
    engine = LLMEngine(art.path, EngineConfig(kv_cache_memory=1 << 22))
    try:
        got = engine.prompt_logprobs(ids.tolist()).double()
    finally:
        engine.shutdown()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


# -- the default model (integration) ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def default_runs(default_model, default_store, default_int4, default_gptq):
    """INT8 (groups of 32), INT4 RTN and INT4 GPTQ (the session's, groups of 64), probed alike."""
    return {"w8": quantize(default_model, QuantizeOptions(bits=8, group_size=32), default_store, progress=False),
            "w4-rtn": default_int4, "w4-gptq": default_gptq}


@pytest.mark.integration
def test_default_model_int8_top1_and_int4_gptq_beats_rtn(default_runs):
    w8, r4, g4 = (default_runs[k].metrics for k in ("w8", "w4-rtn", "w4-gptq"))
    print({k: a.metrics["probe"] for k, a in default_runs.items()})
    assert w8["probe"]["top1"] >= 0.97   # near 0.98, by the CPU's kernels; a broken INT8 is far below
    assert g4["probe"]["kld_mean"] < r4["probe"]["kld_mean"]
    assert default_runs["w4-gptq"].config["group_size"] == 64  # 128 does not divide SmolLM2's 576


@pytest.mark.integration
def test_default_model_checkpoint_sizes(default_runs):
    w8, w4 = default_runs["w8"].metrics, default_runs["w4-rtn"].metrics
    assert 1.8 < w8["linear_ratio_vs_bf16"] <= 2.0
    assert 3.4 < w4["linear_ratio_vs_bf16"] < 4.0
    # the tied 49152 x 576 bf16 embedding stays dense: whole files shrink less
    assert 1.4 < w8["ratio_vs_bf16"] < 2.0
    assert 2.0 < w4["ratio_vs_bf16"] < w4["linear_ratio_vs_bf16"]
