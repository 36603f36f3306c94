"""`--target llmq`: one Hugging Face-style directory per rank, in the source's own compressed-tensors packing.

rank{r}/config.json is the source config with the engine's head counts (padded ones when --pad-heads was needed)
and an explicit head_dim; rank{r}/model.safetensors holds that rank's slices under the source's tensor names (a
group the source stores fused, Phi-3's qkv_proj, by its roles: a rank's q, k and v rows are cut differently), so
the runtime's quantized layers read them exactly as they read an unsharded quantized artifact. lm_head.weight is
always written (tied embeddings are untied: its rows are split, the embedding's are not unless parallel); an INT8
table (`quantize --embedding int8`) is written, sliced and named in the config the same way.
"""

from __future__ import annotations

import copy
from pathlib import Path

from ...models import qformat
from ...models.checkpoint import ShardedWriter, write_json
from ...models.engine_spec import NATIVE
from ...models.linear_weights import LinearWeights
from ...models.reader import CheckpointReader
from ...models.sharding import ShardPlan, kv_scale_slice, layer_slices, split_linear_tensors, split_rows
from .registry import ExportTarget, ReadBack, TargetResult
from .verify import exact, reference_weights


def _put(out: ShardedWriter, lw: LinearWeights, name: str) -> None:
    if lw.qw is None:
        out.add(f"{name}.weight", lw.weight)
    else:
        for k, t in qformat.write_linear(name, lw.qw).items():
            out.add(k, t)
    if lw.bias is not None:
        out.add(f"{name}.bias", lw.bias)


def rank_config(src: CheckpointReader, plan: ShardPlan) -> dict:
    """The source config with this engine's head counts, untied; a tied INT8 table's head becomes its own INT8
    lm_head, named in the quantization config, and modules named by a fused group are named by its roles."""
    cfg = copy.deepcopy(src.config)
    cfg.update(num_attention_heads=plan.padded_heads, num_key_value_heads=plan.padded_kv_heads,
               head_dim=plan.head_dim, tie_word_embeddings=False)
    qc = src.qconfig
    if qc is None or qc.weights is None:
        if qc is not None and qc.read is not None:   # another layout (ModelOpt): the ranks carry compressed-tensors
            cfg.pop("quantization_config")
            cfg |= {"quantization_config": qformat.quantization_config(None, kv=qc.kv)} if qc.kv else {}
        return cfg
    roles = src.arch.role_modules  # a group stored fused (Phi-3's qkv_proj) is written by role here
    modules = {r: args for m, args in qc.modules.items() for r in roles(m)}
    ignore = [r for m in qc.ignore for r in roles(m)]
    if src.embedding_quantized() and qformat.LM_HEAD not in qc.modules:
        modules[qformat.LM_HEAD] = qc.modules[qformat.EMBEDDING]
        ignore = [m for m in ignore if m != qformat.LM_HEAD]
    if modules != dict(qc.modules) or ignore != list(qc.ignore) or qc.read is not None:   # read: ModelOpt's layout
        cfg["quantization_config"] = qformat.quantization_config(qc.weights, qc.input_activations, ignore=ignore,
                                                                 kv=qc.kv, modules=modules, ggml=qc.ggml)
    return cfg


def write_llmq(src: CheckpointReader, plan: ShardPlan, out: Path, engine) -> TargetResult:
    """Write rank0..rank{tp-1} under `out`, each tensor to its rank's files as soon as it is sliced; the record
    names the rank directories and the quantization config every rank carries."""
    names = [f"rank{r}" for r in range(plan.tp)]
    for d in names:
        (out / d).mkdir(parents=True)
    writers = [ShardedWriter(out / d) for d in names]
    try:
        arch = src.arch
        for i in range(src.spec.num_layers):
            norms = {arch.norm(i, role): t for role, t in src.layer_norms(i).items()}
            tensors = src.layer_tensors(i)   # a Gated DeltaNet layer's convolution, decay and norm: cut by heads
            for r, slices in enumerate(layer_slices(src, plan, i)):
                for role, lw in slices.items():
                    _put(writers[r], lw, arch.linear(i, role))
                for name, t in norms.items():
                    writers[r].add(name, t)
                for p, t in split_linear_tensors(tensors, plan, r, arch).items():
                    writers[r].add(f"{arch.prefix(i)}.{p}", t.contiguous())
            del norms, tensors  # before the next layer's tensors are read
            scales = src.kv_scales(i)
            if scales is not None:
                for r in range(plan.tp):
                    for k, t in qformat.write_kv_scales(arch.attention_module(i), kv_scale_slice(scales[0], plan, r),
                                                        kv_scale_slice(scales[1], plan, r)).items():
                        writers[r].add(k, t)
        embed = src.embedding()
        for r in range(plan.tp):
            _put(writers[r], split_rows(embed, plan.vocab_rows(r)) if plan.parallel_embedding else embed,
                 qformat.EMBEDDING)
            writers[r].add(f"{arch.final_norm}.weight", src.final_norm())
        del embed
        lm_head = src.lm_head()
        for r in range(plan.tp):
            _put(writers[r], split_rows(lm_head, plan.vocab_rows(r)), qformat.LM_HEAD)
        del lm_head
    except BaseException:
        for w in writers:
            w.abort()
        raise
    config = rank_config(src, plan)
    for w, d in zip(writers, names):
        w.close()
        write_json(out / d / "config.json", config)
    return TargetResult(outputs={}, ranks=names, quantization=config.get("quantization_config"))


def read_llmq(engine_dir: Path, engine) -> ReadBack:
    """A rank directory is itself a (sliced) checkpoint: each is read as the runtime reads the source."""
    return ReadBack(ranks=[reference_weights(CheckpointReader(engine_dir / d), exact) for d in engine.ranks],
                    plan=engine.plan, foreign=False)


TARGET = ExportTarget(NATIVE, write=write_llmq, read_back=read_llmq)
