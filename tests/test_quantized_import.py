"""`llmq import` of a quantized checkpoint reads every quantized tensor against its config before anything is stored,
as spec.check_tensors does for a dense one: hostile variants of llmq's own compressed-tensors export (groups, bit
widths, scales, packed weights, weight_shape) and of a Hugging Face block-FP8 release are refused in one line naming
the field or tensor, with exit 2 and no new artifact; llmq's own exports import as they are. (ModelOpt's:
tests/test_modelopt_import.py.)"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

L = "model.layers.0.mlp.up_proj"   # [128, 64]: at 4 bits 8 int32 words a row, 2 groups of 32


@pytest.fixture(scope="module")
def made(tmp_path_factory, tiny_model):
    """(store, INT4 groups-of-32 artifact, block-FP8 artifact) of one tiny model: `llmq quantize`'s
    compressed-tensors."""
    from llmq.artifacts import Store
    from llmq.models import resolve_model
    from llmq.pipeline.quantize import QuantizeOptions, quantize

    root = tmp_path_factory.mktemp("qimport")
    store = Store(root / "store")
    src = resolve_model(str(tiny_model()), store)
    int4 = quantize(src, QuantizeOptions(method="rtn", bits=4, group_size=32, probe_tokens=0), store, progress=False)
    fp8 = quantize(src, QuantizeOptions(method="fp8", group_size=128, probe_tokens=0), store, progress=False)
    return store, int4, fp8


def _weights(**change):
    def corrupt(d):
        cfg = json.loads((d / "config.json").read_text())
        cfg["quantization_config"]["config_groups"]["group_0"]["weights"] |= change
        (d / "config.json").write_text(json.dumps(cfg))
    return corrupt


def _tensor(key: str, change):
    def corrupt(d):
        t = load_file(d / "model.safetensors")
        t[key] = change(t[key])
        save_file(t, d / "model.safetensors")
    return corrupt


def _at(value):
    def change(t):
        t = t.clone()
        t[0, 0] = value
        return t
    return change


HOSTILE = {
    "group_size 0": (_weights(group_size=0), r"group_size 0 is not a positive integer"),
    "group_size -32": (_weights(group_size=-32), r"group_size -32 is not a positive integer"),
    "group_size 7": (_weights(group_size=7), r"self_attn.q_proj: group_size 7 does not divide the weight's 64 inputs"),
    "group_size '32'": (_weights(group_size="32"), r"group_size '32' is not a positive integer"),
    "num_bits 0": (_weights(num_bits=0), r"num_bits 0 \(type int\) is not a width llmq computes"),
    "num_bits 64": (_weights(num_bits=64), r"num_bits 64 \(type int\) is not a width llmq computes"),
    "NaN scale": (_tensor(f"{L}.weight_scale", _at(float("nan"))), rf"{L}: weight scale holds nan at \[0, 0\]"),
    "inf scale": (_tensor(f"{L}.weight_scale", _at(float("inf"))), rf"{L}: weight scale holds inf at \[0, 0\]"),
    "zero scale": (_tensor(f"{L}.weight_scale", _at(0.0)), rf"{L}: weight scale holds 0.0 at \[0, 0\]"),
    "scale shape": (_tensor(f"{L}.weight_scale", lambda t: t[:, :1].contiguous()),
                    rf"{L}: weight scale of shape \[128, 1\] does not fit a \[128, 64\] weight in groups of 32"),
    "float32 packed": (_tensor(f"{L}.weight_packed", lambda t: t.float()),
                       rf"{L}: weight_packed float32 \[128, 8\] does not hold weight_shape \[128, 64\] at 4 bits"),
    "half-width packed": (_tensor(f"{L}.weight_packed", lambda t: t[:, :4].contiguous()),
                          rf"{L}: weight_packed int32 \[128, 4\] does not hold weight_shape \[128, 64\] at 4 bits"),
    "weight_shape wider": (_tensor(f"{L}.weight_shape", lambda t: torch.tensor([128, 128])),
                           rf"{L}: weight_packed int32 \[128, 8\] does not hold weight_shape \[128, 128\] at 4"),
    "weight_shape taller": (_tensor(f"{L}.weight_shape", lambda t: torch.tensor([256, 64])),
                            rf"{L}: weight_packed int32 \[128, 8\] does not hold weight_shape \[256, 64\] at 4"),
}


def _import(store, d):
    """`llmq import d`: (exit code, output), and that the store holds no new artifact when it failed."""
    from click.testing import CliRunner

    from llmq.cli.main import cli

    before = sorted(p.name for p in store.root.iterdir())
    run = CliRunner().invoke(cli, ["--store", str(store.root), "import", str(d)])
    if run.exit_code:
        assert sorted(p.name for p in store.root.iterdir()) == before
        assert store.versions(d.name) == []
    return run.exit_code, run.output


def _copy(art, d):
    shutil.copytree(art.path, d, ignore=shutil.ignore_patterns("llmq.json"))
    return d


@pytest.mark.parametrize("corrupt, match", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_hostile_compressed_tensors_checkpoint_is_one_line_and_not_stored(made, tmp_path, corrupt, match):
    store, int4, _ = made
    d = _copy(int4, tmp_path / "hostile")
    corrupt(d)
    code, out = _import(store, d)
    assert code == 2, out
    assert out.count("\n") == 1, out
    assert out.startswith("error: "), out
    assert re.search(match, out), out


def _hf_fp8(art, d):
    """The Hugging Face "fp8" layout of a block-FP8 artifact (DeepSeek-V3 / Qwen3-FP8: weight_scale_inv,
    weight_block_size)."""
    _copy(art, d)
    t = {k.replace(".weight_scale", ".weight_scale_inv"): v for k, v in load_file(d / "model.safetensors").items()}
    save_file(t, d / "model.safetensors")
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("corrupt, match", [
    (_tensor(f"{L}.weight_scale_inv", _at(float("nan"))), rf"{L}: weight scale holds nan at \[0, 0\]"),
    (_tensor(f"{L}.weight_scale_inv", _at(0.0)), rf"{L}: weight scale holds 0.0 at \[0, 0\]"),
    (_tensor(f"{L}.weight_scale_inv", lambda t: torch.ones(2, 2)), rf"{L}: block FP8 tensors .* do not fit"),
    (_tensor(f"{L}.weight", lambda t: t.float()), rf"{L}: block FP8 tensors weight torch.float32"),
], ids=["NaN scale", "zero scale", "scale shape", "float32 weight"])
def test_a_hostile_hugging_face_block_fp8_checkpoint_is_one_line_and_not_stored(made, tmp_path, corrupt, match):
    store, _, fp8 = made
    d = _hf_fp8(fp8, tmp_path / "hostile-fp8")
    corrupt(d)
    code, out = _import(store, d)
    assert code == 2, out
    assert out.count("\n") == 1, out
    assert re.search(match, out), out


def test_llmqs_own_exports_import_as_they_are(made, tmp_path):
    store, int4, fp8 = made
    for d in (_copy(int4, tmp_path / "int4"), _copy(fp8, tmp_path / "fp8"), _hf_fp8(fp8, tmp_path / "hf-fp8")):
        code, out = _import(store, d)
        assert code == 0, out
        assert store.versions(d.name) == [1], out
