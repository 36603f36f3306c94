"""The runtime's weights gathered into one huge-page block (runtime/host_memory)."""

import torch
from torch import nn

from llmq.runtime.host_memory import HUGE_PAGE, gather_weights


def test_gather_moves_every_weight_into_one_block_keeping_values_and_sharing():
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(50, 16, generator=gen).bfloat16()
    a, b = nn.Module(), nn.Module()
    a.register_buffer("table", table)
    a.norm = nn.Parameter(torch.randn(16, generator=gen), requires_grad=False)
    b.register_buffer("head", table)  # tied: the same memory
    b.register_buffer("codes", torch.randint(0, 255, (7, 3), dtype=torch.uint8, generator=gen))
    b.register_buffer("strided", torch.randn(4, 6, generator=gen).t())  # not contiguous: left where it is
    root = nn.Sequential(a, b)
    before = {n: t.clone() for n, t in root.state_dict().items()}
    moved = gather_weights(root)
    assert moved == 64 * (-(-50 * 16 * 2 // 64) + 1 + 1)  # each tensor from a 64-byte boundary, the shared one once
    for n, t in root.state_dict().items():
        assert t.dtype == before[n].dtype
        assert torch.equal(t, before[n])
    assert b.head.data_ptr() == a.table.data_ptr() != table.data_ptr()
    assert isinstance(a.norm, nn.Parameter)
    block = a.table.untyped_storage()
    assert a.norm.data_ptr() % HUGE_PAGE == 0  # the first (module order: parameters, then buffers) starts the block
    assert all(t.untyped_storage().data_ptr() == block.data_ptr() for t in (a.norm, b.codes))
    assert b.strided.untyped_storage().data_ptr() != block.data_ptr()


def test_a_models_weights_share_one_block(tmp_path, make_tiny_model):
    from llmq.runtime import EngineConfig, LLMEngine

    eng = LLMEngine(make_tiny_model(tmp_path / "m"), EngineConfig(max_model_len=64))
    model = eng.runner.model
    storages = {t.untyped_storage().data_ptr() for t in model.state_dict().values() if t.is_contiguous()}
    storages |= {b.untyped_storage().data_ptr() for b in model.buffers() if b.is_contiguous()}
    assert len(storages) == 1
    eng.shutdown()
