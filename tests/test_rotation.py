"""--rotate hadamard (issue 53, item 1): a rotation of the residual stream folded into the weights. The rotated
checkpoint is an ordinary one of its family that computes the same function (transformers runs it: KLD against the
original), and a quantizer sees its outlier channels spread."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import FAMILIES, family_model, runtime_logprobs

from llmq.errors import LlmqError
from llmq.models import ModelSpec
from llmq.models.arch import ARCHS
from llmq.pipeline.quantize.probe import kld_top1
from llmq.pipeline.quantize.rotation import Rotation
from llmq.pipeline.quantize.streamed import source_tensors


@pytest.mark.parametrize("n", [64, 96, 576, 640, 896, 1152, 22])
def test_rotations_are_orthogonal_and_hadamard_where_one_is_built(n):
    """Q Q^T = I for the hidden sizes of the families' models (SmolLM2's 576 = 36 x 16, Gemma 3 270M's 640 = 20 x
    32, Qwen2.5 0.5B's 896 = 28 x 32); every entry of a Hadamard rotation is +-1/sqrt(n); 22 has none (a random
    orthogonal matrix then). Q is applied by its Kronecker factors (butterflies for the power of two), to a batch as
    to each row."""
    rot = Rotation(n, seed=3)
    eye = torch.eye(n, dtype=torch.float64)
    q = rot.right(eye)
    assert torch.allclose(q @ q.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
    assert rot.kind == ("orthogonal" if n == 22 else "hadamard")
    if rot.kind == "hadamard":
        assert torch.allclose(q.abs(), torch.full_like(q, n ** -0.5), atol=1e-14)
    x = torch.randn(2, 3, n, dtype=torch.float64)
    assert torch.allclose(rot.right(x), torch.stack([torch.stack([rot.right(r) for r in b]) for b in x]), atol=1e-12)
    assert not torch.equal(Rotation(n, seed=4).right(eye), q)   # the signs follow the seed


def _logits(path, spec, tensors):
    """transformers' model of `path` (MoE experts as the quantize stage installs them, one linear each) given
    `tensors` module by module as the quantize stage loads them, its head its own; float32 logits of fresh tokens."""
    from torch import nn

    from llmq.models import qformat
    from llmq.pipeline.quantize.streamed import load, skeleton

    model, arch = skeleton(path, spec.arch, torch.float32, "cpu"), spec.arch
    for name in (qformat.EMBEDDING, arch.final_norm, *(arch.prefix(i) for i in range(spec.num_layers))):
        load(model.get_submodule(name), name, tensors, "cpu")
    model.lm_head.weight = nn.Parameter(tensors["lm_head.weight" if "lm_head.weight" in tensors
                                                else "model.embed_tokens.weight"].float())
    ids = torch.randint(0, spec.vocab_size, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        return model.float()(ids).logits.flatten(0, 1).double()


@pytest.mark.parametrize("family", [f for f in FAMILIES if ARCHS[f].rotation_refused is None and
                                    ARCHS[f].build_refused is None])
def test_the_rotated_checkpoint_computes_the_same_function(family, tmp_path):
    """Every family that allows it, rotated: transformers' model over the rotated tensors (a tied head untied) gives
    the original's distributions (KLD <= 1e-6 in float32), while every linear reading or writing the residual
    stream and the embedding have changed (an unrotated or half-rotated model fails one side)."""
    path = family_model(tmp_path / family, family)
    spec = ModelSpec.from_config(path)
    plain, rotated = source_tensors(path, spec), source_tensors(path, spec, "hadamard", seed=1)
    assert kld_top1(_logits(path, spec, plain), _logits(path, spec, rotated))["kld_mean"] <= 1e-6
    last, arch = spec.num_layers - 1, spec.arch
    paths = arch.writer_paths(spec.num_experts, last in spec.linear_layers) + [
        c for _, norm, cons in arch.feed_paths(spec.num_experts, last in spec.linear_layers) if norm for c in cons]
    turned = [f"{arch.prefix(last)}.{p}.weight" for p in paths] + ["model.embed_tokens.weight", "lm_head.weight"]
    assert not [k for k in turned if torch.equal(plain[k if k in plain else "model.embed_tokens.weight"].float(),
                                                 rotated[k].float())]


def test_sandwich_norms_are_refused(tmp_path):
    """Gemma 3's norms after attention and the MLP scale the branches channel by channel before the residual: no
    rotation passes them; one line, naming why."""
    path = family_model(tmp_path / "g", "gemma3_text")
    with pytest.raises(LlmqError, match="cannot rotate Gemma3ForCausalLM: its norms after attention") as e:
        source_tensors(path, ModelSpec.from_config(path), "hadamard")
    assert "\n" not in str(e.value)


def test_rotation_spreads_an_outlier_channel_and_the_runtime_serves_it(tmp_path, tiny_model):
    """A tied bf16 model whose linears reading the residual stream hold a few weights 12x their row's spread (the
    outliers rotations are for: one sets a row's INT4 scale and rounds the rest to a handful of levels): INT4
    per-channel RTN of the rotated model stays far closer to the 16-bit model than of the plain one (the quantize
    stage's probe), and llmq's runtime serves the rotated artifact (its own lm_head now) as the probe measured it,
    against the unrotated source."""
    from safetensors.torch import load_file, save_file

    from llmq.artifacts import Store
    from llmq.models import resolve_model
    from llmq.pipeline.quantize import QuantizeOptions, quantize

    path = tiny_model(seed=2, name="outlier", bf16=True, tie_word_embeddings=True)
    t = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(3)
    for k, w in t.items():
        if k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")):
            cols = torch.randint(0, w.shape[1], (w.shape[0], 2), generator=gen)
            w.scatter_(1, cols, (12 * w.float().std(1, keepdim=True)).expand(-1, 2).to(w.dtype))
    save_file(t, path / "model.safetensors", metadata={"format": "pt"})
    store = Store(tmp_path / "s")
    src = resolve_model(str(path), store)
    arts = {r: quantize(src, QuantizeOptions(method="rtn", bits=4, group_size=0, probe_tokens=512, rotate=r), store,
                        progress=False) for r in ("none", "hadamard")}
    kld = {r: a.metrics["probe"]["kld_mean"] for r, a in arts.items()}
    assert kld["hadamard"] < 0.5 * kld["none"], kld
    rotated = arts["hadamard"]
    assert rotated.config["rotation"] == {"kind": "hadamard", "size": 64, "paley": 32, "sylvester": 2, "seed": 0,
                                        "untied_lm_head": True}
    assert json.loads((rotated.path / "config.json").read_text())["tie_word_embeddings"] is False
    ids = torch.randint(0, 256, (96,), generator=torch.Generator().manual_seed(8)).tolist()
    got = kld_top1(runtime_logprobs(src.path, ids), runtime_logprobs(rotated.path, ids))["kld_mean"]
    assert 0.3 * kld["hadamard"] < got < 3 * kld["hadamard"], (got, kld)
