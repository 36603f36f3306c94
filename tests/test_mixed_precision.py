"""`llmq quantize --target-bpw`: the sensitivity pass measures what it says, the knapsack is optimal, and what cannot
be honoured is refused before any work. (The checkpoint's groups, widths and transformers' reading of them:
test_export_compressed_tensors.py; the GGUF export of a mixed artifact: test_export_gguf.py.)"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from llmq.errors import LlmqError
from llmq.pipeline.quantize import QuantizeOptions, mixed


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from helpers import tiny_bf16_store

    return tiny_bf16_store(tmp_path_factory.mktemp("mixed"), seed=9, num_hidden_layers=3)


@pytest.mark.parametrize("seed", range(6))
def test_the_knapsack_is_optimal_and_keeps_the_budget(seed):
    """Against brute force over every assignment of 7 items x 3 options."""
    g = np.random.default_rng(seed)
    costs = np.sort(g.integers(1, 60, (7, 3)), axis=1).astype(float) * 384
    losses = np.sort(g.random((7, 3)), axis=1)[:, ::-1].copy()
    losses[:, 2] = 0.0
    budget = int(costs[:, 0].sum() + g.random() * (costs[:, 2].sum() - costs[:, 0].sum()))
    best = min((sum(losses[i, j] for i, j in enumerate(pick)), pick)
               for pick in itertools.product(range(3), repeat=7)
               if sum(costs[i, j] for i, j in enumerate(pick)) <= budget)
    got = mixed.choose(losses, costs, budget)
    assert sum(costs[i, j] for i, j in enumerate(got)) <= budget
    assert sum(losses[i, j] for i, j in enumerate(got)) == pytest.approx(best[0], abs=1e-12)


def test_a_budget_below_the_cheapest_choice_is_refused():
    with pytest.raises(LlmqError, match="below the smallest choice"):
        mixed.choose(np.ones((2, 2)), np.array([[5.0, 9.0], [5.0, 9.0]]), 9)


def test_sensitivity_is_the_kld_of_rounding_that_unit_alone(tiny):
    """Each unit's number equals the KLD of the whole float model with just that unit's linears on the 4-bit grid,
    computed independently with transformers (a wrong layer, unit or grid gives another number)."""
    from transformers import AutoModelForCausalLM

    from llmq.models.load import load_tokenizer
    from llmq.pipeline.quantize import rtn
    from llmq.pipeline.quantize.calib import load_calibration
    from llmq.pipeline.quantize.probe import kld_top1
    from llmq.pipeline.quantize.stage import validate

    store, src = tiny
    opts, spec, _ = validate(src, QuantizeOptions(bits=4, group_size=32, target_bpw=6, num_samples=2, seq_len=64))
    windows = load_calibration(None, load_tokenizer(src.path), 2, 64, 0)
    got = mixed.measure(src.path, spec, opts, windows, "cpu", False, mixed.candidates(spec, opts))
    units = spec.arch.unit_paths()
    assert set(got) == {(i, u) for i in range(3) for u in range(len(units))}

    model = AutoModelForCausalLM.from_pretrained(src.path, dtype=torch.float32).eval()
    ids = torch.stack(windows.samples)
    half = ids.shape[1] // 2  # scored: the second half of each window
    with torch.no_grad():
        ref = model(ids).logits[:, half:]
    klds = []
    for (i, u) in [(0, 0), (1, 3), (2, 2), (2, 1)]:
        lins = [model.get_submodule(f"{spec.arch.prefix(i)}.{n}") for n in units[u]]
        kept = [lin.weight.data.clone() for lin in lins]
        for lin in lins:
            lin.weight.data = rtn.quantize_weight(lin.weight.data, 4, 32, True, torch.bfloat16,
                                                  search=opts.search).dequantize()
        with torch.no_grad():
            want = kld_top1(ref, model(ids).logits[:, half:])["kld_mean"]
        for lin, w in zip(lins, kept):
            lin.weight.data = w
        assert got[(i, u)]["kld"] == {"int4": pytest.approx(want, rel=1e-3)}, (i, u)
        mse = got[(i, u)]["mse"]
        assert 0 < mse["int8"] / mse["int4"] < 0.02  # 8-bit rows: ~1/256 of a 4-bit group's squared error
        klds.append(want)
    assert len(set(np.round(klds, 9))) == len(klds)  # distinct units really measure different things


def test_the_plan_fits_the_budget_and_spends_it_where_the_kld_falls_most(tiny):
    from llmq.models.load import load_tokenizer
    from llmq.pipeline.quantize.calib import load_calibration
    from llmq.pipeline.quantize.stage import validate

    store, src = tiny
    calib = load_calibration(None, load_tokenizer(src.path), 4, 64, 0)
    estimates = []
    for target in (5, 6, 8.5, 16):
        opts, spec, _ = validate(src, QuantizeOptions(bits=4, group_size=32, target_bpw=target, num_samples=4,
                                                      seq_len=64))
        plan = mixed.plan(src.path, spec, opts, calib, "cpu", progress=False)
        m = plan.manifest
        assert m["bytes"] <= m["budget_bytes"]
        assert m["bpw"] <= target
        assert len(plan.bits) == 7 * 3
        assert {b for b in plan.bits.values()} <= {4, 8, 16}
        estimates.append(m["estimated_kld"])
        if target == 16:
            assert set(plan.bits.values()) == {16}
            assert m["estimated_kld"] == 0
        if target == 5:  # room for a few units at 8 bits, none at 16
            eight = [u for u in m["units"] if u["bits"] == 8]
            assert eight
            assert m["count"]["16bit"] == 0
    assert estimates == sorted(estimates, reverse=True)
    assert estimates[0] > estimates[1] > 0


def test_what_target_bpw_cannot_honour_is_refused_before_any_work(tiny):
    from llmq.pipeline.quantize import quantize

    store, src = tiny
    for bad, match in [(dict(method="smoothquant", bits=8), "--target-bpw mixes"),
                       (dict(method="rtn", bits=8), "--target-bpw mixes"),
                       (dict(method="rtn", bits=4, per_tensor=True), "--target-bpw mixes")]:
        with pytest.raises(LlmqError, match=match):
            QuantizeOptions(target_bpw=6, **bad).check()
    with pytest.raises(LlmqError, match=">"):
        QuantizeOptions(target_bpw=4).check()
    with pytest.raises(LlmqError, match=r"--target-bpw 4.4 is below the 4.500 bits per weight"):
        quantize(src, QuantizeOptions(bits=4, group_size=32, target_bpw=4.4, num_samples=2, seq_len=64,
                                      probe_tokens=0), store, progress=False)
    assert not any("bpw4.4" in str(p) for p in store.root.rglob("*"))  # nothing left behind


@pytest.mark.parametrize("extra", [{}, {"embedding": "int8"}, {"embedding": "int8", "int8_group_size": 32}])
def test_max_size_spends_what_the_file_leaves_and_never_passes_it(tiny, extra):
    """`--max-size`: the budget is the size less everything outside the decoder linears, priced as stored (here a
    bf16 or an INT8 table); the file is at most that size, and the room above a plain 4-bit file buys 8-bit units."""
    from llmq.pipeline.quantize import quantize

    store, src = tiny
    common = dict(bits=4, group_size=32, num_samples=4, seq_len=64, probe_tokens=0, **extra)
    plain = quantize(src, QuantizeOptions(**common), store, progress=False)
    limit = plain.metrics["size_bytes"] + 60_000
    art = quantize(src, QuantizeOptions(max_size=f"{limit / 1000:g}kB", **common), store, progress=False)
    m = art.config["mixed_precision"]
    assert plain.metrics["size_bytes"] < art.metrics["size_bytes"] <= limit
    assert m["count"]["int8"] > 0
    assert art.config["options"]["max_size"] == f"{limit / 1000:g}kB"
    assert m["target_bpw"] == art.config["options"]["target_bpw"]
    # nothing but the headers' allowance (256 bytes an entry, real ones are ~100) and less than one more unit's
    # upgrade is left unspent
    assert limit - art.metrics["size_bytes"] < 256 * 100 + 4 * 64 * 128
    eight = {k: v for k, v in art.config["scheme_per_module"].items() if v.startswith("W8")}
    want = f"W8A16-group{extra['int8_group_size']}-sym" if "int8_group_size" in extra else "W8A16-channel-sym"
    assert eight
    assert set(eight.values()) == {want}  # the 8-bit units and the table: per channel, or Q8_0's groups


@pytest.mark.parametrize("extra", [{}, {"embedding": "int8", "int8_group_size": 32}])
def test_max_size_in_gguf_bytes_holds_for_the_gguf_file(tiny, extra):
    """`--size-in gguf`: the budget is the .gguf file's (metadata, tokenizer, F32 norms, 18 / 34-byte blocks): the
    file `build --target gguf` writes is at most the size asked, and short of it by less than one more unit's
    upgrade plus the padding allowance."""
    from llmq.pipeline.quantize import quantize
    from llmq.pipeline.targets import BuildOptions, build_engine

    store, src = tiny
    common = dict(bits=4, group_size=32, num_samples=4, seq_len=64, probe_tokens=0, **extra)
    plain = quantize(src, QuantizeOptions(**common, name=f"plain-gguf{len(extra)}"), store, progress=False)
    def gguf_size(quantized) -> int:
        engine = build_engine(quantized, store, BuildOptions(target="gguf"))
        return next(p for p in engine.path.glob("*.gguf") if not p.name.endswith(".imatrix.gguf")).stat().st_size

    plain_bytes = gguf_size(plain)
    limit = plain_bytes + 40_000
    art = quantize(src, QuantizeOptions(max_size=str(limit), size_in="gguf", **common), store, progress=False)
    m = art.config["mixed_precision"]
    assert m["count"]["int8"] + m["count"]["16bit"] > 0
    gguf_bytes = gguf_size(art)
    assert plain_bytes < gguf_bytes <= limit
    units = len(art.config["mixed_precision"]["units"])
    assert limit - gguf_bytes < 2 * 64 * 128 * 2 + 31 * 4 * units + 255, (limit, gguf_bytes)


def test_size_in_gguf_needs_a_budget_and_gguf_blocks():
    with pytest.raises(LlmqError, match="--size-in gguf prices"):
        QuantizeOptions(size_in="gguf").check()
    with pytest.raises(LlmqError, match="multiples of 32"):
        QuantizeOptions(max_size="1GB", size_in="gguf", bits=4, group_size=16).check()


def test_a_max_size_below_the_4_bit_floor_is_refused_before_any_work(tiny):
    from llmq.pipeline.quantize import quantize

    store, src = tiny
    with pytest.raises(LlmqError, match=r"--max-size 90kB leaves -?[0-9.]+ bits per decoder weight, which is below"):
        quantize(src, QuantizeOptions(bits=4, group_size=32, max_size="90kB", num_samples=2, seq_len=64,
                                      probe_tokens=0), store, progress=False)
    assert not any("max90kB" in str(p) for p in store.root.rglob("*"))
    with pytest.raises(LlmqError, match="two spellings of one budget"):
        QuantizeOptions(max_size="1GB", target_bpw=6).check()
    with pytest.raises(LlmqError, match="cannot read 'lots' as a size"):
        QuantizeOptions(max_size="lots").check()
    with pytest.raises(LlmqError, match="--max-size mixes"):
        QuantizeOptions(max_size="1GB", method="smoothquant", bits=8).check()
