"""The build stage: (model or quantized artifact, options) -> engine artifact, written atomically by the target the
registry names (`registry.py`: its refusals, its writer, its reader for --verify)."""

from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

from ...artifacts import Artifact, Store
from ...errors import GateFailed, LlmqError
from ...models.checkpoint import copy_tokenizer
from ...models.engine_spec import NATIVE
from ...models.vision import runs_images
from ...options import Options, option
from ...runtime.config import KV_DTYPES
from .registry import TARGETS, target

if TYPE_CHECKING:
    from ...models.reader import CheckpointReader


@dataclass(frozen=True)
class BuildOptions(Options):
    tp: int = option(1, "Tensor-parallel ranks: 1, 2, 4 or 8.", choices=(1, 2, 4, 8))
    pp: int = option(1, "Pipeline-parallel stages (only 1 today).", ge=1)
    target: str = option(NATIVE, "; ".join(f"{t.name}: {t.help}" for t in TARGETS.values()) + ".",
                         choices=tuple(TARGETS))
    max_batch_size: int = option(64, "Sequences in a batch.", ge=1, aliases=("max_num_seqs",))
    max_seq_len: int | None = option(None, "Context length (default: the model's positions, at most 4096).", ge=1,
                                     aliases=("max_model_len",))
    kv: str = option("auto", "KV-cache dtype; int8/fp8 use the scales from `llmq quantize-kv`.", choices=KV_DTYPES,
                     aliases=("kv_cache_dtype",))
    block_size: int = option(16, "Paged KV-cache block size (tokens).", ge=1)
    pad_heads: bool = option(True, "Pad head counts tp does not divide with zero heads (exact); --no-pad-heads "
                             "refuses instead.")
    parallel_embedding: bool = option(False, "Split the embedding by vocabulary too.")
    verify: bool = option(False, "Run the reference check (TP logits vs the unsharded model) first.")
    probe_tokens: int = option(2048, "--target gguf: held-out tokens on which the build measures the KLD of the "
                               "file as llama.cpp's CPU arithmetic computes it (modelled) beside llmq's runtime "
                               "(0: skip).", ge=0)
    name: str | None = option(None, "Engine artifact name (default: <source>-tp<N>[-<target>]).")

    def check(self) -> None:
        super().check()
        target(self.target).check_verify(self.verify)
        if self.pp != 1:
            raise LlmqError(f"--pp {self.pp}: pipeline parallelism is not supported yet; use --pp 1")


def _check(opts: BuildOptions, src: CheckpointReader) -> None:
    opts.check()
    if opts.max_seq_len and opts.max_seq_len > src.spec.max_position_embeddings:
        raise LlmqError(f"--max-seq-len {opts.max_seq_len} exceeds the model's {src.spec.max_position_embeddings} "
                        "positions")


def kv_cache_dtype(requested: str, src: CheckpointReader) -> str:
    """The engine's KV-cache dtype: what the source was calibrated for, checked against what the user asked."""
    have = src.kv_cache_dtype()
    if requested == "auto":
        return have or "auto"
    if have is None and requested == "int8":
        raise LlmqError("--kv int8 needs calibrated KV-cache scales and this artifact has none; "
                        "run `llmq quantize-kv REF --kv int8` first")
    if have is not None and have != requested:
        raise LlmqError(f"--kv {requested}: this artifact's KV-cache scales are calibrated for {have}; "
                        f"use --kv {have} or re-run `llmq quantize-kv REF --kv {requested}`")
    return requested


def _dtype_of(src: CheckpointReader) -> str:
    """The dense tensors' dtype, read from the final norm's header rather than trusted from config.json."""
    return str(src.tensors.info(f"{src.arch.final_norm}.weight")[0]).removeprefix("torch.")


def _quality(export, source: Artifact, src: CheckpointReader, store: Store, tokens: int) -> dict:
    """The target's modelled quality against the model at the root of the source's lineage (the source itself
    when it is a model)."""
    from ...evals.evaluate import default_baseline
    from ...models.reader import CheckpointReader

    base = source if source.kind == "model" else default_baseline(store, source)
    if base is None:
        return {"skipped": f"no model artifact in {source.ref}'s lineage to compare with"}
    return {"baseline": base.ref, **export.quality(src, CheckpointReader(base.path), tokens)}


def build_engine(source: Artifact, store: Store, opts: BuildOptions, command: str | None = None) -> Artifact:
    """Shard `source` for opts.tp ranks into a new engine artifact; optionally run the reference check first."""
    from ...models.engine_spec import EngineSpec  # torch: imported here, so the CLI reads BuildOptions without it
    from ...models.reader import CheckpointReader
    from ...models.sharding import HeadSplitError, make_plan

    src = CheckpointReader(source.path)
    if src.arch.build_refused:
        raise LlmqError(f"--target {opts.target}: {source.ref} ({src.spec.architecture}): {src.arch.build_refused}; "
                        f"serve {source.ref} itself (llmq serve)")
    _check(opts, src)
    if src.bnb is not None:
        raise LlmqError(f"{source.ref} is a bitsandbytes checkpoint: serve and eval it as it is (llmq, transformers, "
                        "vLLM's bitsandbytes loader and TGI load it directly); build targets take compressed-tensors "
                        "artifacts (rtn, gptq, awq, smoothquant, fp8)")
    if src.spec.vision is not None and (opts.target != "gguf" or not runs_images(src.spec.vision)):
        why = "its towers are not run by llmq yet" if opts.target == "gguf" else \
            "its rank shards and TensorRT-LLM's checkpoint are not done; --target gguf writes it with an mmproj"
        raise LlmqError(f"--target {opts.target}: build does not write this vision-language model yet ({why}); "
                        f"serve {source.ref} itself (llmq serve), or load it in vLLM / SGLang / transformers "
                        "(compressed-tensors)")
    if src.spec.linear_layers and opts.target == "trtllm":
        raise LlmqError(f"--target trtllm: build does not write {src.spec.architecture}'s Gated DeltaNet layers yet; "
                        f"build --target llmq or gguf, serve {source.ref} itself (llmq serve), or load it in vLLM "
                        "(compressed-tensors)")
    try:
        plan = make_plan(src.spec, opts.tp, pad_heads=opts.pad_heads, parallel_embedding=opts.parallel_embedding)
    except HeadSplitError as e:
        raise LlmqError(f"--{e}; drop --no-pad-heads to add zero heads (exact, {e.padded[0]} heads / {e.padded[1]} "
                        "KV heads)") from None
    except LlmqError as e:
        raise LlmqError(f"--{e}") from None   # "tp N ...", as this command spells it
    kv = kv_cache_dtype(opts.kv, src)
    max_seq_len = opts.max_seq_len or min(src.spec.max_position_embeddings, 4096)
    name = opts.name or f"{source.name}-tp{opts.tp}" + ("" if opts.target == NATIVE else f"-{opts.target}")
    spec = EngineSpec(target=opts.target, tp=opts.tp, pp=opts.pp, max_batch_size=opts.max_batch_size,
                      max_seq_len=max_seq_len, kv_cache_dtype=kv, block_size=opts.block_size, dtype=_dtype_of(src),
                      source={"id": source.id, "name": source.name, "kind": source.kind},
                      source_ids=[source.id, *source.parents], plan=plan)
    export = target(opts.target)
    export.refuse(src, spec)
    config = {"options": asdict(opts), "plan": plan.to_dict(), "kv_cache_dtype": kv, "max_seq_len": max_seq_len}
    with store.create("engine", name, parents=[source.id], config=config, command=command,
                      needs=source.payload_bytes) as w:  # the source's tensors, sliced (head padding adds little)
        result = export.write(src, plan, w.dir, spec)
        spec = replace(spec, ranks=result.ranks, quantization=result.quantization, outputs=result.outputs)
        copy_tokenizer(source.path, w.dir)
        if (source.path / "generation_config.json").is_file():
            shutil.copyfile(source.path / "generation_config.json", w.dir / "generation_config.json")
        spec.write(w.dir)
        w.metrics.update(size_bytes=sum(p.stat().st_size for p in w.dir.rglob("*")
                                        if p.suffix in (".safetensors", ".gguf")),
                         compile=result.compile)
        if export.quality is not None and opts.probe_tokens:
            w.metrics["quality"] = _quality(export, source, src, store, opts.probe_tokens)
        if opts.verify:
            from .verify import verify_engine

            checked = verify_engine(w.dir, source.path)
            w.metrics["verify"] = checked
            if not checked["passed"]:
                raise GateFailed(f"reference check failed: max relative error {checked['max_rel_error']:.3g} > "
                                 f"{checked['tolerance']:g} (tp={opts.tp}, target={opts.target}); nothing written")
    return w.artifact

