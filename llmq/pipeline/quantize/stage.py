"""The quantize stage: (model artifact, QuantizeOptions) -> quantized artifact.

Everything the user can get wrong is checked before the model is loaded; the checkpoint is written through
`llmq.models.qformat` only (sink.py), inside the store's writer, so a failure leaves nothing behind. The payload is a
pure function of the inputs (fixed seeds, sorted tensors, no timestamps), so the same inputs give the same content id;
wall time and memory go into the manifest's metrics, which are not part of the id.
"""

from __future__ import annotations

import dataclasses
import math
import resource
import shutil
import sys
import time
from collections import Counter
from typing import NamedTuple

from ...artifacts import Artifact, Store
from ...errors import LlmqError
from ...models import ModelSpec, importance
from ...models.checkpoint import read_config, write_json
from .methods import Method, load_method
from .options import GRID_FALLBACK, QuantizeOptions


def _in_features(spec: ModelSpec) -> dict[str, int]:
    """The decoder linears' input widths, each with the roles that have it ("q_proj/k_proj/...")."""
    by_width: dict[int, list[str]] = {}
    for i, role in dict.fromkeys((i, r) for i in range(spec.num_layers) for r in spec.roles(i)):
        name, k = role.rpartition(".")[2], spec.linear_shape(role, i)[1]   # layer i's (Gemma 4's differ)
        if role != "router" and name not in by_width.setdefault(k, []):
            by_width[k].append(name)
    return {"/".join(names): k for k, names in by_width.items()}


def grid_manifest(opts: QuantizeOptions, ggml: dict[str, str], rest: int) -> dict:
    """--grid's account in the manifest: the layer linears on its grid, then on each fallback in turn (`ggml`: module
    -> its GGML grid; `rest`: the linears on the INT4 one), each with the width that sent them there."""
    counts = Counter(ggml.values())
    why = f"input width not a multiple of {opts.grid.upper()}'s 256-weight super-block"
    fallbacks = []
    if (grid := GRID_FALLBACK.get(opts.grid)) is not None:
        fallbacks.append({"linears": counts[grid], "scheme": grid.upper(), "why": f"{why} (llama.cpp's fallback)"})
        why = f"input width not a multiple of {grid.upper()}'s 32-weight block either"
    fallbacks.append({"linears": rest, "scheme": "INT4 asymmetric groups of 32 (GGUF Q4_1)", "why": why})
    return {"grid": opts.grid, "grid_linears": counts[opts.grid], "grid_fallback": fallbacks}


class Validated(NamedTuple):
    """What `validate` found: the options resolved for the model, its spec and the method."""

    opts: QuantizeOptions
    spec: ModelSpec
    method: Method


def validate(source: Artifact, opts: QuantizeOptions) -> Validated:
    """Every check that needs no model weights."""
    opts.check()
    method = load_method(opts.method)
    if source.kind == "quantized" or "quantization_config" in read_config(source.path):
        raise LlmqError(f"{source.ref} is already quantized (weights or KV cache); quantize the model it came from "
                        f"({', '.join(p[:12] for p in source.parents) or 'its source'}) and run quantize-kv last")
    if source.kind != "model":
        raise LlmqError(f"{source.ref} is a {source.kind} artifact; quantize takes a model")
    spec = ModelSpec.from_config(read_config(source.path))
    in_features = _in_features(spec)
    o = opts.resolved(tuple(in_features.values()))
    takes = spec.arch.quantize_methods
    if takes is not None and (o.method not in takes or o.mixed):
        raise LlmqError(f"{spec.architecture}: quantize takes --method {', '.join(takes)} with one scheme for every "
                        f"linear; {'mixed precision' if o.mixed else o.method} is not done for it yet")
    if o.rotate != "none":
        from .rotation import check_rotatable

        check_rotatable(spec)
    if spec.vision is not None:
        from ...models import vision

        vision.check_quantize(o, spec)
    if method.validate is not None:  # what the method cannot honour first (a bitsandbytes packing of fused Phi-3)
        method.validate(o, spec)
    if o.group_size < 0:
        raise LlmqError("--group-size must be a positive number of columns, or 0 / -1 for per channel; "
                        f"got {opts.group_size}")
    if o.group_size:
        if o.per_tensor:
            raise LlmqError("--per-tensor and --group-size N exclude each other")
        bad = {k: v for k, v in in_features.items() if v % o.group_size}
        if bad and not method.partial_groups:
            raise LlmqError(f"--group-size {o.group_size} does not divide the input features of "
                            + ", ".join(f"{k} ({v})" for k, v in bad.items()))
    if o.int8_group_size:
        widths = {**(in_features if o.mixed else {}), **({"embedding": spec.hidden_size}
                                                                 if o.embedding == "int8" else {}),
                  **({"lm_head": spec.hidden_size} if o.lm_head == "int8" else {})}
        bad = {k: v for k, v in widths.items() if v % o.int8_group_size}
        if bad:
            raise LlmqError(f"--int8-group-size {o.int8_group_size} does not divide the input features of "
                            + ", ".join(f"{k} ({v})" for k, v in bad.items()))
    if o.mixed:
        from .mixed import bpw_for_size, check
        from .streamed import stored_dtype

        if o.max_size is not None:
            o = dataclasses.replace(o, target_bpw=math.floor(bpw_for_size(source.path, spec, o) * 1e4) / 1e4)
        check(spec, o, stored_dtype(source.path).itemsize)
    return Validated(o, spec, method)


def peak_rss_bytes() -> int:
    """Peak resident memory of this process so far (ru_maxrss is KiB on Linux, bytes on macOS)."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r if sys.platform == "darwin" else r * 1024)


def peak_memory(device: str) -> dict:
    """The run's peak memory metrics: resident memory, and on a GPU the peak its tensors held there (the caching
    allocator's high-water mark of allocated bytes)."""
    out = {"peak_rss_bytes": peak_rss_bytes()}
    if device.startswith("cuda"):
        import torch

        out["peak_device_bytes"] = int(torch.cuda.max_memory_allocated(device))
    return out


def quantize(source: Artifact, opts: QuantizeOptions, store: Store, progress: bool = True,
             command: str | None = None) -> Artifact:
    """Quantize `source` (a model artifact) and commit the quantized artifact."""
    from ...models import qformat, vision
    from .calib import load_calibration, load_probe_text
    from .calib_images import image_count, with_images
    from .experts import expert_coverage
    from .layerwise import run_layerwise
    from .sink import CheckpointSink
    from .streamed import source_tensors

    t0 = time.perf_counter()
    opts, spec, method = validate(source, opts)
    from ...models.load import load_tokenizer

    calibrated = method.needs_calibration(opts) or opts.mixed
    given = [flag for flag, on in (("--calib", opts.calib), ("--thinking", opts.thinking != "auto"),
                                   ("--no-chat-template", not opts.chat_template)) if on]
    if given and not calibrated:
        raise LlmqError(f"{' / '.join(given)}: method {opts.method} with these options uses no calibration data; "
                        f"drop {' and '.join(given)}")
    tokenizer = load_tokenizer(source.path)
    images = image_count(spec, opts.image_share, opts.num_samples)
    if opts.image_share and not calibrated:
        raise LlmqError(f"--image-share: method {opts.method} with these options uses no calibration data; drop it")
    calib = with_images(load_calibration(opts.calib, tokenizer, opts.num_samples, opts.seq_len, opts.seed,
                                         opts.chat_template, opts.thinking),
                        source.path, tokenizer, images, opts.chat_template) if calibrated else None
    probe = load_probe_text(tokenizer, opts.probe_tokens, opts.chat_template) if opts.probe_tokens else None

    name = opts.name or f"{source.name}-{opts.method}-" + (f"w{opts.bits}" + (
        f"g{opts.group_size}" if opts.group_size else "") + ("" if opts.symmetric else "-asym") if opts.grid == "int"
        else opts.grid) + opts.tags + (
        "-head8" if opts.lm_head == "int8" else "") + (
        "-rot" if opts.rotate != "none" else "") + ("-emb8" if opts.embedding == "int8" else "") + (
        f"-max{opts.max_size.replace(' ', '')}" if opts.max_size else f"-bpw{opts.target_bpw:g}" if opts.target_bpw
        else "") + (f"-for{opts.for_engine}" if opts.for_engine else "")
    from ...models.checkpoint import ShardedWriter, copy_tokenizer

    tensors = source_tensors(source.path)   # a vision-language model's tower, copied as stored
    with store.create("quantized", name, parents=[source.id], command=command, needs=source.payload_bytes) as w, \
            ShardedWriter(w.dir, rename=tensors.stored_name) as out:  # never larger than its source
        plan = None
        if opts.target_bpw is not None:
            from ...models.load import pick_device
            from .mixed import plan as mixed_plan

            plan = mixed_plan(source.path, spec, opts, calib, pick_device(opts.device), progress)
        sink = CheckpointSink(out, opts, (*(plan.dense if plan else ()), *spec.kept_16bit()))
        result = run_layerwise(source.path, method, opts, spec, calib=calib, probe=probe, sink=sink,
                               progress=progress, widths=plan.bits if plan else None,
                               formats=plan.formats if plan else None)
        for n in sorted(tensors.vision):
            out.add(n, tensors.vision_tensor(n))
        out.close()
        if result.importance:
            importance.write(w.dir, result.importance, calib.source, calib.tokens, len(calib.samples),
                             len(calib.samples[0]))
        config = dict(read_config(source.path))
        config["quantization_config"], fmt = sink.quantization_config()
        if spec.vision is not None:
            config["quantization_config"] = vision.quantization_config(config["quantization_config"])
        if qformat.LM_HEAD in sink.outside or opts.rotate != "none":
            config["tie_word_embeddings"] = False   # the table stays 16-bit for the lookup / is rotated, not folded
        per_module = sink.scheme_per_module()
        if qformat.EMBEDDING in sink.outside and config.get("tie_word_embeddings"):
            per_module[qformat.LM_HEAD] = per_module[qformat.EMBEDDING]   # the head is the tied INT8 table
        w.config.update({
            "format": fmt, "method": opts.method, "bits": opts.bits, "group_size": opts.group_size or None,
            "symmetric": opts.symmetric, "strategy": opts.strategy, "scheme": per_module["Linear"],
            "scheme_per_module": per_module, **({"mixed_precision": plan.manifest} if plan else {}),
            **(grid_manifest(opts, sink.ggml, len(sink.args)) if opts.grid != "int" else {}),
            "excluded_modules": [m for m in opts.ignored if m not in per_module],
            "dense_modules": sorted(sink.dense_modules),
            "options": {k: v for k, v in dataclasses.asdict(opts).items() if k not in ("name", "device", "calib")},
            "calibration": calib.manifest() if calib is not None else None,
            **({"expert_coverage": expert_coverage(result.routed, calib)} if spec.num_experts else {}),
            "probe": probe.manifest() if probe is not None else None,
            **({"rotation": result.rotation} if result.rotation else {}),
            **({"method_layers": result.method_layers} if result.method_layers else {}),
            **({"vision": vision.manifest(tensors.vision_info(), len(calib.images) if calib is not None else 0)}
               if spec.vision is not None else {}),
            "source": {"id": source.id, "ref": source.ref},
        })
        write_json(w.dir / "config.json", config)
        if (source.path / "generation_config.json").is_file():
            shutil.copyfile(source.path / "generation_config.json", w.dir / "generation_config.json")
        copy_tokenizer(source.path, w.dir)
        size = sum(p.stat().st_size for p in w.dir.glob("*.safetensors"))
        source_size = sum(p.stat().st_size for p in source.path.glob("*.safetensors"))
        outside_bf16 = 2 * sum(o[2] for n, o in sink.outside.items()   # a tied model has one table to count
                               if not (n == qformat.LM_HEAD and spec.tie_word_embeddings))
        bf16_size = 2 * (sink.dense_params + sink.linear_params + sink.bias_params) + outside_bf16
        linear_bytes, linear_params = sink.linear_bytes, sink.linear_params
        w.metrics.update(
            wall_time_s=round(time.perf_counter() - t0, 2), **peak_memory(result.device),
            layer_times_s=result.layer_times, size_bytes=size, source_bytes=source_size, bf16_bytes=bf16_size,
            ratio_vs_source=round(source_size / size, 3), ratio_vs_bf16=round(bf16_size / size, 3),
            linear_bytes=linear_bytes, linear_bf16_bytes=2 * linear_params,
            linear_ratio_vs_bf16=round(2 * linear_params / linear_bytes, 3), device=result.device,
            **({"probe": result.probe} if result.probe else {}))
    return w.artifact
