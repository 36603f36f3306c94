"""Checkpoints are read and written a tensor at a time (llmq.models.safetensors_io), and quantize holds one decoder
layer at a time: the properties that let an 8B model be quantized on a 24 GiB machine, asserted without timing."""

from __future__ import annotations

import json
import math
import re
import struct
import weakref

import pytest
import torch

from llmq.errors import LlmqError
from llmq.models import resolve_model
from llmq.models.checkpoint import INDEX_NAME, ShardedWriter, save_state_dict
from llmq.models.reader import LazyTensors
from llmq.models.safetensors_io import SafetensorsWriter, TensorFile
from llmq.pipeline.quantize import QuantizeOptions, quantize


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return {"f32": r(3, 5), "bf16": r(7).bfloat16(), "f16": r(2, 2, 2).half(), "f64": r(4).double(),
            "i8": torch.randint(-128, 127, (9, 4), generator=g, dtype=torch.int8),
            "u8": torch.randint(0, 255, (6,), generator=g, dtype=torch.uint8),
            "i32": torch.randint(-9, 9, (3,), generator=g, dtype=torch.int32), "bool": r(5) > 0,
            "fp8": r(4, 4).clamp(-400, 400).to(torch.float8_e4m3fn), "scalar": r(()), "empty": torch.empty(0, 3),
            "strided": r(4, 6)[:, ::2]}


def test_writer_output_is_what_the_safetensors_package_reads(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    ts = _tensors(1)
    with SafetensorsWriter(tmp_path / "a.safetensors", metadata={"format": "pt", "k": "v"}) as w:
        for k, t in ts.items():
            w.add(k, t)
    assert not list(tmp_path.glob("*.body"))
    back = load_file(str(tmp_path / "a.safetensors"))
    ours = TensorFile(tmp_path / "a.safetensors")
    assert set(back) == set(ts) == set(ours.keys())
    for k, t in ts.items():
        for got in (back[k], ours.get(k)):
            assert got.dtype == t.dtype
            assert got.shape == t.shape
            assert torch.equal(_bytes(got), _bytes(t))
    with safe_open(str(tmp_path / "a.safetensors"), "pt") as h:
        assert h.metadata() == {"format": "pt", "k": "v"}
    (n,) = struct.unpack("<Q", (tmp_path / "a.safetensors").read_bytes()[:8])
    assert n % 8 == 0  # data 8-byte aligned, as the safetensors package writes it


def test_files_the_safetensors_package_wrote_read_the_same(tmp_path):
    from safetensors.torch import save_file

    ts = {k: v.contiguous() for k, v in _tensors(2).items()}
    save_file(ts, str(tmp_path / "b.safetensors"))
    f = TensorFile(tmp_path / "b.safetensors")
    for k, t in ts.items():
        got = f.get(k)
        assert got.dtype == t.dtype
        assert got.shape == t.shape
        assert torch.equal(_bytes(got), _bytes(t))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _corrupt(raw: bytes, how: str) -> bytes:
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    if how == "truncated":
        return raw[:-3]
    if how == "length":
        return struct.pack("<Q", len(raw) * 2) + raw[8:]
    if how == "not-json":
        return raw[:8] + b"{" * n + raw[8 + n:]
    if how == "overlap":
        header["b"]["data_offsets"] = header["a"]["data_offsets"]
    if how == "shape":
        header["a"]["shape"] = [5]
    body = json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body + raw[8 + n:]


@pytest.mark.parametrize("how, match", [("truncated", "take"), ("length", "header length"), ("not-json", "JSON"),
                                        ("overlap", "overlap or leave a gap"), ("shape", "bytes for shape")])
def test_damaged_files_are_refused_in_one_line(tmp_path, how, match):
    with SafetensorsWriter(tmp_path / "ok.safetensors") as w:
        w.add("a", torch.ones(4))
        w.add("b", torch.zeros(4))
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(_corrupt((tmp_path / "ok.safetensors").read_bytes(), how))
    with pytest.raises(LlmqError, match=f"not a readable safetensors file .*{re.escape(match)}"):
        TensorFile(bad)


def test_a_failed_write_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with ShardedWriter(tmp_path, shard_bytes=64) as w:
            for i in range(5):
                w.add(f"t{i}", torch.ones(16))
            raise RuntimeError("stage failed")
    assert list(tmp_path.iterdir()) == []


def test_shards_and_index_load_in_transformers(tmp_path, make_tiny_model):
    from transformers import AutoModelForCausalLM

    src = make_tiny_model(tmp_path / "src")
    model = AutoModelForCausalLM.from_pretrained(str(src))
    state = {k: v for k, v in model.state_dict().items()}
    out = tmp_path / "out"
    out.mkdir()
    files = save_state_dict(state, out, shard_bytes=20_000)
    assert len(files) > 3
    assert files[-1] == INDEX_NAME
    index = json.loads((out / INDEX_NAME).read_text())
    assert set(index["weight_map"]) == set(state)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())
    for name in ("config.json", "tokenizer.json"):
        (out / name).write_bytes((src / name).read_bytes())
    again = AutoModelForCausalLM.from_pretrained(str(out))
    for k, v in again.state_dict().items():
        assert torch.equal(v, state[k]), k
    one = tmp_path / "one"
    one.mkdir()
    assert save_state_dict(state, one) == ["model.safetensors"]


class LayerTracker:
    """Wraps LazyTensors.__getitem__: counts reads per tensor and records every read of a decoder layer's tensor made
    while tensors read for other decoder layers are still alive (held by anyone) -- more than one linear's worth (a
    loop variable may hold the previous linear while the next is read; a held layer or model shows up as dozens)."""

    def __init__(self, monkeypatch):
        self.alive: list[tuple[str, weakref.ref]] = []
        self.reads: dict[str, int] = {}
        self.violations: list[str] = []
        original = LazyTensors.__getitem__

        def tracked(lazy, name):
            t = original(lazy, name)
            self.reads[name] = self.reads.get(name, 0) + 1
            here = _layer_of(name)
            others = [n for n, r in self.alive if r() is not None and _layer_of(n) not in (None, here)]
            if here is not None and len({n.rsplit(".", 1)[0] for n in others}) > 1:
                self.violations.append(f"{name} read while {others[0]} alive")
            self.alive.append((name, weakref.ref(t)))
            return t

        monkeypatch.setattr(LazyTensors, "__getitem__", tracked)


def _layer_of(name: str) -> str | None:
    return name.split(".")[2] if name.startswith("model.layers.") else None


def test_quantize_holds_one_decoder_layer_at_a_time(tmp_path, store, make_tiny_model, monkeypatch):
    """Every layer tensor is read from the checkpoint exactly once, and when one is read no tensor read for another
    decoder layer is still alive: the model is never whole in memory (the old from_pretrained path read no layer
    tensor through the reader and held all of them)."""
    src = resolve_model(str(make_tiny_model(tmp_path / "m", num_hidden_layers=4)), store)
    track = LayerTracker(monkeypatch)
    quantize(src, QuantizeOptions(method="gptq", bits=4, group_size=32, num_samples=4, seq_len=32, probe_tokens=64),
             store, progress=False)
    layer_tensors = [n for n in TensorFile(next(src.path.glob("*.safetensors"))).keys()
                     if n.startswith("model.layers.")]
    assert len(layer_tensors) == 4 * 9
    assert {n: track.reads.get(n) for n in layer_tensors} == {n: 1 for n in layer_tensors}
    assert track.violations == []


@pytest.mark.parametrize("target", ["llmq", "trtllm"])
def test_build_writes_each_layer_before_reading_the_next(tmp_path, store, make_tiny_model, monkeypatch, target):
    """Both build targets at tp 2 stream: no decoder layer's tensors are still held (by a rank's pending state)
    when the next layer is read (the old writers kept every rank's whole state dict until the end)."""
    from llmq.pipeline.targets import BuildOptions, build_engine

    src = resolve_model(str(make_tiny_model(tmp_path / "m", num_hidden_layers=4, hidden_size=128,
                                            intermediate_size=256)), store)
    q = quantize(src, QuantizeOptions(method="rtn", bits=4, group_size=64, probe_tokens=0), store, progress=False)
    track = LayerTracker(monkeypatch)
    build_engine(q, store, BuildOptions(tp=2, target=target))
    assert any(_layer_of(n) == "3" for n in track.reads)
    assert track.violations == []


def test_the_runtime_builds_each_layer_as_it_reads_it(tmp_path, store, make_tiny_model, monkeypatch):
    """Loading an engine reads layer i's tensors only after layer i-1's runtime modules exist (the old loader read
    the whole checkpoint first: checkpoint and runtime copies of every layer at the peak); an untied embedding table
    stays in its stored dtype, cast per looked-up row."""
    from llmq.runtime import EngineConfig, LLMEngine
    from llmq.runtime.models import decoder

    src = resolve_model(str(make_tiny_model(tmp_path / "m", num_hidden_layers=4)), store)
    q = quantize(src, QuantizeOptions(method="rtn", bits=4, group_size=32, probe_tokens=0), store, progress=False)
    events: list[tuple[str, int]] = []
    read, built = LazyTensors.__getitem__, decoder.DecoderLayer.__init__

    def reading(lazy, name):
        if _layer_of(name) is not None:
            events.append(("read", int(_layer_of(name))))
        return read(lazy, name)

    def building(layer, *args, **kwargs):
        events.append(("built", sum(1 for e in events if e[0] == "built")))
        built(layer, *args, **kwargs)

    monkeypatch.setattr(LazyTensors, "__getitem__", reading)
    monkeypatch.setattr(decoder.DecoderLayer, "__init__", building)
    eng = LLMEngine(q.path, EngineConfig(max_num_seqs=2, max_model_len=64, kv_cache_memory=16 << 20,
                                         dtype="bfloat16"))
    try:
        assert eng.runner.model.embed.dtype == torch.float32  # stored float32: kept, not made the compute bfloat16
        assert eng.runner.model.norm.weight.dtype == torch.bfloat16
    finally:
        eng.shutdown()
    order = [e for e in events if e[0] == "built" or e[1] is not None]
    assert [e for e in order if e[0] == "built"] == [("built", i) for i in range(4)]
    for n, (kind, i) in enumerate(order):
        if kind == "read":
            done = sum(1 for k, _ in order[:n] if k == "built")
            assert done == i, f"layer {i} read after {done} layers were built"


def test_quantize_kv_never_holds_two_models(tmp_path, store, make_tiny_model, monkeypatch):
    """The reference pass (full-precision cache) is spilled to disk and its engine shut down -- its weights freed --
    before the artifact's engine loads (it used to keep both: two copies of an 8B model's weights)."""
    from llmq.pipeline.kvcache import KVOptions, quantize_kv
    from llmq.runtime import LLMEngine

    src = resolve_model(str(make_tiny_model(tmp_path / "m")), store)
    live: set[int] = set()
    peak = [0]
    init, shutdown = LLMEngine.__init__, LLMEngine.shutdown

    def start(eng, *a, **k):
        init(eng, *a, **k)
        live.add(id(eng))
        peak[0] = max(peak[0], len(live))

    models: list[weakref.ref] = []

    def stop(eng):  # shutdown may be called again (idempotent)
        if getattr(eng, "runner", None) is not None:
            models.append(weakref.ref(eng.runner.model))
        live.discard(id(eng))
        shutdown(eng)
        assert models[-1]() is None, "shutdown left the engine's weights in memory"

    monkeypatch.setattr(LLMEngine, "__init__", start)
    monkeypatch.setattr(LLMEngine, "shutdown", stop)
    art = quantize_kv(src, store, KVOptions(kv="int8", num_samples=2, seq_len=32, probe_tokens=64), show_progress=False)
    assert peak[0] == 1
    assert not live
    assert 0 <= art.manifest["metrics"]["probe"]["kld_mean"] < 0.05


def test_the_kv_budget_counts_packed_weights_as_stored(tmp_path, store, make_tiny_model, monkeypatch):
    """A KV budget from a fraction of free memory subtracts what the weights will take loaded: packed INT4 as
    stored, 16-bit matrices at the compute dtype's width. (It used to subtract 4x the file: an 8B INT4 artifact,
    5.3 GB on disk, left no memory for any KV cache on a 24 GB machine.)"""
    from llmq.models.reader import CheckpointReader
    from llmq.runtime import EngineConfig, LLMEngine
    from llmq.runtime import worker as worker_mod

    src = resolve_model(str(make_tiny_model(tmp_path / "m", hidden_size=256, intermediate_size=512)), store)
    q = quantize(src, QuantizeOptions(method="rtn", bits=4, group_size=64, probe_tokens=0), store, progress=False)
    ckpt = CheckpointReader(q.path)
    files = sum(p.stat().st_size for p in q.path.glob("*.safetensors"))
    dense = sum(math.prod(ckpt.tensors.info(n)[1]) * 4 for n in ckpt.tensors if not n.endswith(
        ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")))
    packed = sum(math.prod(ckpt.tensors.info(n)[1]) * ckpt.tensors.info(n)[0].itemsize for n in ckpt.tensors
                 if n.endswith(("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")))
    assert ckpt.runtime_bytes(torch.float32) == dense + packed
    monkeypatch.setattr(worker_mod, "available_memory", lambda device: 3 * files)
    eng = LLMEngine(q.path, EngineConfig(max_num_seqs=2, max_model_len=64, kv_cache_fraction=0.5))
    try:
        assert eng.num_blocks * eng.block_size >= 64
    finally:
        eng.shutdown()


def test_kld_refuses_when_both_models_cannot_be_loaded(tmp_path, store, make_tiny_model, monkeypatch):
    """eval's kld holds the evaluated model and the baseline at once: when their weights exceed the memory available
    it says so in one line before loading the baseline (at 8B the bf16 baseline alone is 32 GB in float32)."""
    from llmq.evals.evaluate import _check_both_fit
    from llmq.models.reader import CheckpointReader
    from llmq.runtime import worker as worker_mod

    src = resolve_model(str(make_tiny_model(tmp_path / "m")), store)
    q = quantize(src, QuantizeOptions(method="rtn", bits=8, probe_tokens=0), store, progress=False)
    need = sum(CheckpointReader(a.path).runtime_bytes(torch.float32) for a in (q, src))
    monkeypatch.setattr(worker_mod, "available_memory", lambda device: need)
    _check_both_fit(q, src)  # exactly enough
    monkeypatch.setattr(worker_mod, "available_memory", lambda device: need - 1)
    with pytest.raises(LlmqError, match="loaded together: about .* GiB of weights"):
        _check_both_fit(q, src)
