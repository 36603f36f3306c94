"""`llmq quantize-kv`: calibrate INT8 / FP8 KV-cache scales on data and store them in a new artifact.

The calibration runs the model through the bundled runtime (dense or any quantized weights, exactly as it will be
served) and observes what every layer writes into its paged cache (LLMEngine.observe_kv): K after RoPE and V, which
is what the cache holds. The absolute maximum per layer and KV head gives scale = amax / 127 (int8) or amax / 448
(fp8 e4m3), per tensor or per head, and the held-out error is measured with the runtime cache's own encode / decode
(`llmq.quant`). Per-head scales pay only where heads differ in range, so `auto` measures the reconstruction error of
both on held-out text and keeps per-head scales only when they cut it by a meaningful margin. The artifact is the input
checkpoint (weights untouched) plus each attention module's `k_scale` / `v_scale` (Arch.attention_module) and
a `kv_cache_scheme` in `quantization_config`; its quality (KLD / top-1 agreement of the model with the
quantized cache against the same model with a full-precision cache, both through the runtime's paged path) is
measured on the written artifact.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from .. import quant
from ..artifacts import Artifact, Store
from ..errors import LlmqError
from ..models import qformat
from ..models.checkpoint import INDEX_NAME, read_config, safetensors_files, write_json
from ..models.reader import CheckpointReader
from .kv_options import KVOptions

SCALES_FILE = "kv-scales.safetensors"
MANIFEST = "llmq.json"


def fake_quantize(x: torch.Tensor, scale: torch.Tensor, kv: str) -> torch.Tensor:
    """x [T, Hkv, D] through the cache's quantizer and back with a [1] or [Hkv] scale (the runtime cache's encode /
    decode, in float32)."""
    s = scale.float().reshape(1, -1, 1)
    return quant.decode_kv(quant.encode_kv(x, s, fp8=kv == "fp8"), s, torch.float32)


def scales_from_amax(amax: torch.Tensor, kv: str, per_head: bool) -> torch.Tensor:
    """[Hkv] per-head absmax -> scale [Hkv] (per head) or [1] (per tensor)."""
    return quant.absmax_scale(amax if per_head else amax.max().reshape(1), fp8=kv == "fp8")


class KVRecorder:
    """An LLMEngine.observe_kv callback: sees K and V exactly as each layer's cache receives them ([T, Hkv, D]).

    Records the per-head absmax (calibration) or, once `measure(candidates)` was called, the squared reconstruction
    error of each candidate set of scales (held-out measurement)."""

    def __init__(self, kv_heads: list[int], kv: str):
        """kv_heads: each layer's KV heads (its cache's: ModelSpec.kv_heads_of; layers without a cache of their own
        record nothing)."""
        self.kv = kv
        self.amax = [torch.zeros(2, h) for h in kv_heads]
        self.candidates: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.sq_err: dict[str, torch.Tensor] = {}
        self.sq_sum = torch.zeros(len(kv_heads), 2, dtype=torch.float64)

    def measure(self, candidates: dict[str, list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        self.candidates = candidates
        self.sq_err = {g: torch.zeros_like(self.sq_sum) for g in candidates}
        self.sq_sum.zero_()

    def __call__(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        for j, x in enumerate((k, v)):
            xf = x.detach().float().cpu()
            if not self.candidates:
                self.amax[layer][j] = torch.maximum(self.amax[layer][j], xf.abs().amax(dim=(0, 2)))
                continue
            self.sq_sum[layer, j] += float(xf.double().square().sum())
            for g, scales in self.candidates.items():
                err = fake_quantize(xf, scales[layer][j], self.kv) - xf
                self.sq_err[g][layer, j] += float(err.double().square().sum())

    def relative_errors(self) -> dict[str, dict[str, float]]:
        """Per candidate: sum ||x - q(x)||^2 / sum ||x||^2 over every layer, for K, V and both."""
        tot = self.sq_sum.clamp_min(1e-30)
        return {g: {"k": float(e[:, 0].sum() / tot[:, 0].sum()), "v": float(e[:, 1].sum() / tot[:, 1].sum()),
                    "kv": float(e.sum() / tot.sum())} for g, e in self.sq_err.items()}


def _check(source: Artifact, opts: KVOptions) -> CheckpointReader:
    opts.check()
    if source.kind not in ("model", "quantized"):
        raise LlmqError(f"{source.ref} is a {source.kind} artifact; quantize-kv takes a model or quantized artifact")
    ckpt = CheckpointReader(source.path)
    if ckpt.bnb is not None:
        raise LlmqError(f"{source.ref} is a bitsandbytes checkpoint, whose format has no KV-cache scales; run "
                        "quantize-kv on a compressed-tensors artifact (rtn, gptq, awq, smoothquant, fp8) or a model")
    from .quantize.calib_images import image_count

    image_count(ckpt.spec, opts.image_share, opts.num_samples)   # one line for images a model does not take
    have = ckpt.kv_cache_dtype()
    if have is not None:
        raise LlmqError(f"{source.ref} already carries calibrated {have} KV-cache scales; "
                        "run quantize-kv on the artifact it was made from")
    return ckpt


def _engine(path: Path, max_len: int, opts: KVOptions):
    from ..runtime import EngineConfig, LLMEngine

    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=max(512, max_len), max_model_len=max_len,
                       enable_prefix_caching=False, device=opts.device)
    return LLMEngine(path, cfg)


Sample = tuple[list[int], "torch.Tensor | None"]   # token ids, and a vision-language prompt's pixel values


def _run(engine, samples: list[Sample], progress: Callable[[int], None]) -> None:
    """Prefill every sample (one token generated, never cached): the cache sees all of their K/V, image tokens
    included."""
    from ..runtime import SamplingParams

    for i in range(0, len(samples), 8):
        batch = samples[i:i + 8]
        engine.generate([ids for ids, _ in batch], SamplingParams(max_tokens=1, temperature=0),
                        images=[pixels for _, pixels in batch])
        progress(len(batch))


def _choose(opts: KVOptions, errors: dict[str, dict[str, float]]) -> str:
    if opts.granularity != "auto":
        return opts.granularity
    return "head" if errors["head"]["kv"] <= (1 - opts.margin) * errors["tensor"]["kv"] else "tensor"


def kv_quant_args(kv: str, granularity: str) -> qformat.QuantArgs:
    return qformat.QuantArgs(8, type="int" if kv == "int8" else "float", symmetric=True,
                             strategy="attn_head" if granularity == "head" else "tensor")


def _write_checkpoint(src: Path, dst: Path, config: dict, scales: dict[str, torch.Tensor]) -> None:
    """The source checkpoint plus a safetensors file of scales, with an index naming every tensor's file.

    A single `model.safetensors` becomes shard 1 of 2 (the scales shard 2): loaders such as transformers read a lone
    model.safetensors and ignore an index beside it. Weight files are hard-linked where the filesystem allows (both
    copies are read-only), else copied."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    sharded = (src / INDEX_NAME).is_file()
    scales_name = SCALES_FILE if sharded else "model-00002-of-00002.safetensors"
    for f in src.iterdir():
        if f.is_file() and f.name not in (MANIFEST, "config.json", INDEX_NAME):
            target = dst / ("model-00001-of-00002.safetensors" if f.name == "model.safetensors" and not sharded
                            else f.name)
            try:
                os.link(f, target)
            except OSError:
                shutil.copyfile(f, target)
    save_file(scales, str(dst / scales_name), metadata={"format": "pt"})
    weight_map, total = {}, 0
    for f in safetensors_files(dst):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                weight_map[k] = f.name
        total += f.stat().st_size
    write_json(dst / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
    write_json(dst / "config.json", config)


def _with_kv_scheme(config: dict, qargs: qformat.QuantArgs) -> dict:
    """config.json with `kv_cache_scheme` added: into the existing quantization_config (everything else kept),
    or a KV-only compressed-tensors config for a model whose weights are dense."""
    out = dict(config)
    qc = config.get("quantization_config")
    if qc:
        qc = dict(qc)
        qc["kv_cache_scheme"] = qargs.to_ct().model_dump(mode="json", exclude_none=True)
    else:
        qc = qformat.quantization_config(None, kv=qargs)
    out["quantization_config"] = qc
    return out


class SpilledLogprobs:
    """The reference pass's next-token log-probabilities, written to a temporary file window by window and read
    back one window at a time: the quantized-cache pass then runs after the reference engine is gone, so the probe
    never holds two copies of the weights (an 8B model's). Costs tokens x vocab x 4 bytes of disk, not memory."""

    def __init__(self):
        import tempfile

        self._file = tempfile.TemporaryFile()
        self._index: list[tuple[int, tuple[int, int]]] = []

    def append(self, lp: torch.Tensor) -> None:
        a = lp.detach().float().cpu().contiguous().numpy()
        self._index.append((self._file.tell(), a.shape))
        self._file.write(a.tobytes())

    def __getitem__(self, i: int) -> torch.Tensor:
        import numpy as np

        offset, shape = self._index[i]
        self._file.seek(offset)
        return torch.from_numpy(np.fromfile(self._file, dtype=np.float32, count=shape[0] * shape[1]).reshape(shape))

    def close(self) -> None:
        self._file.close()


def _probe(ref: SpilledLogprobs, test, windows: list[list[int]], step: Callable[[], None]) -> dict:
    """KLD / top-1 agreement of `test`'s next-token distributions against the spilled reference's (both through
    the paged path)."""
    from .quantize.probe import ProbeAccumulator

    acc = ProbeAccumulator()
    for i, w in enumerate(windows):
        acc.add(ref[i], test.prompt_logprobs(w))
        step()
    return acc.result()


def _windows(tw, max_len: int) -> list[list[int]]:
    return [s[:max_len - 1].tolist() for s in tw.samples]


def calibrate(engine, kv: str, samples: list[Sample], heldout: list[list[int]], bar) -> tuple[dict, dict]:
    """Run the calibration samples, derive per-tensor and per-head scales, measure both on held-out windows.
    Returns ({"tensor"|"head": [(k_scale, v_scale)] per layer}, {"tensor"|"head": relative errors})."""
    spec = engine.spec
    rec = KVRecorder([spec.kv_heads_of(i) for i in range(spec.num_layers)], kv)
    with engine.observe_kv(rec):
        task = bar.add_task("calibrating KV cache", total=len(samples))
        _run(engine, samples, lambda n: bar.advance(task, n))
        candidates = {g: [(scales_from_amax(a[0], kv, g == "head"), scales_from_amax(a[1], kv, g == "head"))
                          for a in rec.amax] for g in ("tensor", "head")}
        rec.measure(candidates)
        task = bar.add_task("held-out K/V error", total=len(heldout))
        _run(engine, [(w, None) for w in heldout], lambda n: bar.advance(task, n))
    return candidates, rec.relative_errors()


def quantize_kv(source: Artifact, store: Store, opts: KVOptions, command: str | None = None,
                show_progress: bool = True) -> Artifact:
    """Calibrate `source`'s KV cache, measure both granularities on held-out text, write the new artifact."""
    from rich.console import Console
    from rich.progress import Progress

    from ..models.load import load_tokenizer
    from .quantize.calib import load_calibration, load_probe_text
    from .quantize.calib_images import image_count, with_images
    from .quantize.stage import peak_memory

    ckpt = _check(source, opts)
    t0 = time.perf_counter()
    spec = ckpt.spec
    tokenizer = load_tokenizer(source.path)
    calib = with_images(load_calibration(opts.calib, tokenizer, opts.num_samples, opts.seq_len, seed=0),
                        source.path, tokenizer, image_count(spec, opts.image_share, opts.num_samples))
    probe = load_probe_text(tokenizer, opts.probe_tokens)
    max_len = min(spec.max_position_embeddings,
                  max(len(s) for s in [*calib.samples, *probe.samples, *(ids for ids, _ in calib.images)]) + 1)
    if any(len(ids) >= max_len for ids, _ in calib.images):
        raise LlmqError(f"an image calibration conversation is longer than this model's context ({max_len - 1} "
                        "tokens); pass --image-share 0")
    samples, heldout = [(w, None) for w in _windows(calib, max_len)] + list(calib.images), _windows(probe, max_len)
    reference = SpilledLogprobs()
    with Progress(console=Console(stderr=True), disable=not show_progress, transient=True) as bar:
        try:
            engine = _engine(source.path, max_len, opts)
            try:
                candidates, errors = calibrate(engine, opts.kv, samples, heldout, bar)
                task = bar.add_task("reference: full-precision cache", total=len(heldout))
                for w in heldout:
                    reference.append(engine.prompt_logprobs(w))
                    bar.advance(task)
                device = str(engine.device)
            finally:
                engine.shutdown()
            chosen = _choose(opts, errors)
            qargs = kv_quant_args(opts.kv, chosen)
            scales = {}
            for i in spec.kv_layers():   # the layers keeping a KV cache (not a hybrid's Gated DeltaNet layers, nor
                # Gemma 4's sharing ones)
                scales.update(qformat.write_kv_scales(spec.arch.attention_module(i), *candidates[chosen][i]))
            config = {"kv_cache_dtype": opts.kv, "granularity": chosen, "granularity_requested": opts.granularity,
                      "margin": opts.margin, "kv_cache_scheme": asdict(qargs),
                      "calibration": {**calib.manifest(), "heldout": probe.manifest()},
                      **({"recurrent_state": {"layers": list(spec.linear_layers), "dtype": "float32", "why":
                          "Gated DeltaNet layers keep a fixed-size recurrent state, not a KV cache: not quantized"}}
                         if spec.linear_layers else {}),
                      "source_weights": ckpt.qconfig.format if ckpt.quantized else "dense",
                      "source": {"id": source.id, "ref": source.ref}}
            name = opts.name or f"{source.name}-kv{opts.kv}"
            with store.create("quantized", name, parents=[source.id], config=config, command=command) as w:
                stored = ckpt.tensors.stored_name   # the checkpoint's own layout (a vision-language one's prefix)
                _write_checkpoint(source.path, w.dir, _with_kv_scheme(read_config(source.path), qargs),
                                  {stored(n): t for n, t in scales.items()})
                quant = _engine(w.dir, max_len, opts)  # the artifact as written, read back by the runtime
                try:
                    task = bar.add_task("KLD vs full-precision cache", total=len(heldout))
                    quality = _probe(reference, quant, heldout, lambda: bar.advance(task))
                finally:
                    quant.shutdown()
                w.metrics.update(
                    granularity=chosen, kv_error=errors, probe=quality,
                    kv_bytes_per_token=spec.kv_bytes_per_token(1),
                    kv_bytes_per_token_16bit=spec.kv_bytes_per_token(2),
                    wall_time_s=round(time.perf_counter() - t0, 2), **peak_memory(device),
                    size_bytes=sum(p.stat().st_size for p in w.dir.glob("*.safetensors")))
        finally:
            reference.close()
    return w.artifact
