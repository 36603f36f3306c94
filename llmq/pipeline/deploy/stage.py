"""The deploy stage: (model, quantized or engine artifact, options) -> a `deploy` artifact holding the sized launch
commands of one serving engine (README.md for people, deploy.json for scripts, any file the engine needs)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from ...artifacts import Artifact, Store
from ...errors import LlmqError
from ...options import DraftOptions, Options, add_fields, draft_artifact, option
from .engines import DRAFT_DIR, ENGINES, HEAD, MODEL_DIR, Engine, Launch, Loadable, Speculation
from .sizing import ACTIVATION_MARGIN, GPUS, MEMORY_FRACTION, Load, Sizing, choose, gib, smallest


@dataclass(frozen=True)
@add_fields(DraftOptions)
class DeployOptions(DraftOptions if TYPE_CHECKING else Options):   # a type checker reads the added fields
    engine: str = option(help="The serving engine the commands are for.", choices=tuple(ENGINES))
    gpu: str = option("h100", "GPU kind the layout is sized for.", choices=tuple(GPUS))
    gpus_per_node: int | None = option(None, "GPUs per node: 1, 2, 4 or 8 (default: the fewest that fit).",
                                       choices=(1, 2, 4, 8))
    nodes: int | None = option(None, "Nodes (default: the fewest that fit).", ge=1)
    max_seq_len: int | None = option(None, "Tokens per sequence (default: the model's positions).", ge=1,
                                     aliases=("max_model_len",))
    max_concurrency: int = option(32, "Sequences served at once.", ge=1)
    threads: int | None = option(None, "llama-server's CPU threads (default: llama.cpp's choice).", ge=1)
    name: str | None = option(None, "Deploy artifact name (default: <source>-<engine>).")


def _tokenizer_dir(art: Artifact, store: Store):
    """Where an artifact's tokenizer is: its own directory, or an engine's source's."""
    if art.kind != "engine":
        return art.path
    from ...models.engine_spec import EngineSpec

    return store.by_id(EngineSpec.read(art.path).source["id"]).path


def speculation(opts: DeployOptions, source: Artifact, store: Store, engine: Engine,
                context: int) -> tuple[Speculation | None, Artifact | None]:
    """What opts.speculative asks the engine to run, and the draft's artifact: a draft REF is loaded as the engine
    loads a target (so it refuses what the engine cannot load), must have the target's tokenizer (the vocabulary
    llmq's runtime compares) and reach the context (vLLM would shorten max_model_len to the draft's)."""
    if opts.speculative is None:
        return None, None
    if opts.speculative == "ngram":
        return Speculation(opts.num_speculative_tokens), None
    from ...models import load_tokenizer

    art = draft_artifact(opts.speculative, store)
    try:
        draft = engine.load(art, store)
    except LlmqError as e:
        raise LlmqError(f"--speculative {opts.speculative}: {e}") from None
    vocab = [load_tokenizer(_tokenizer_dir(a, store)).get_vocab() for a in (art, source)]
    if vocab[0] != vocab[1]:
        raise LlmqError(f"--speculative {opts.speculative}: {art.ref} has a different tokenizer than {source.ref}; a "
                        "draft model must share the target's")
    if draft.spec.max_position_embeddings < context:
        raise LlmqError(f"--speculative {opts.speculative}: {art.ref} has {draft.spec.max_position_embeddings} "
                        f"positions, fewer than the {context} tokens a sequence is sized for; lower --max-seq-len")
    return Speculation(opts.num_speculative_tokens, draft), art


def deploy(source: Artifact, store: Store, opts: DeployOptions, command: str | None = None) -> Artifact:
    """Size and write the launch of `source` on opts.engine; refuses, before anything is written, an artifact the
    engine cannot load and a layout that cannot fit."""
    opts.check()
    engine = ENGINES[opts.engine]
    model = engine.load(source, store)
    positions = model.spec.max_position_embeddings
    if opts.max_seq_len and opts.max_seq_len > positions:
        raise LlmqError(f"--max-seq-len {opts.max_seq_len} exceeds the model's {positions} positions")
    context = opts.max_seq_len or positions
    sp, draft = speculation(opts, source, store, engine, context)
    draft_bytes = 0 if draft is None else sp.draft.weight_bytes + int(
        sp.draft.spec.kv_bytes_per_token(2) * context * opts.max_concurrency)
    load = Load(model.spec, model.weight_bytes, 1 if model.kv_fp8 else 2, context, opts.max_concurrency, draft_bytes)
    sizing = choose(load, opts.gpu, engine.to_ranks, opts.gpus_per_node, opts.nodes)
    others = {g: smallest(load, g, engine.to_ranks) for g in GPUS}
    launch = engine.launch(model, sizing, {"served_name": source.name, "max_seq_len": context,
                                           "max_concurrency": opts.max_concurrency, "threads": opts.threads,
                                           "speculation": sp})
    table = [*sizing_table([sizing]), "", "The smallest layout that fits, per GPU kind:", "",
             *sizing_table([s for s in others.values() if s])]
    record = {"engine": engine.name, "source": {"id": source.id, "ref": source.ref, "kind": source.kind},
              "model": model.model or ".", "max_seq_len": context, "max_concurrency": opts.max_concurrency,
              "kv_cache_dtype": "fp8" if model.kv_fp8 else "auto", "sizing": sizing.to_dict(),
              "smallest_per_gpu": {g: s.to_dict() if s else None for g, s in others.items()},
              "steps": [asdict(s) for s in launch.steps], "instead": [asdict(s) for s in launch.instead],
              "files": sorted(launch.files), "notes": [*model.notes, *launch.notes],
              "speculative": None if sp is None else {
                  "method": "ngram" if draft is None else "draft", "num_speculative_tokens": sp.k,
                  "draft": None if draft is None else {"id": draft.id, "ref": draft.ref, "kind": draft.kind,
                                                       "model": sp.draft.model or "."}},
              "checked": engine.checked, "port": engine.port, "table": table}
    name = opts.name or f"{source.name}-{engine.name}"
    parents = [source.id] + ([draft.id] if draft else [])
    with store.create("deploy", name, parents=parents, config={"options": asdict(opts)}, command=command) as w:
        for file, text in launch.files.items():
            (w.dir / file).write_text(text)
        (w.dir / "deploy.json").write_text(json.dumps(record, indent=2) + "\n")
        (w.dir / "README.md").write_text(readme(source, name, engine.label, model, sizing, launch, record, draft))
        w.metrics.update(gpus=sizing.gpus_per_node * sizing.nodes, tp=sizing.tp, pp=sizing.pp,
                         gib_per_gpu=round(sizing.need / 2**30, 3))
    return w.artifact


def sizing_table(rows: list[Sizing]) -> list[str]:
    """Markdown rows of the memory per GPU of each layout (also what the CLI prints)."""
    out = ["| GPU | GPUs x nodes | tp x pp | weights | KV cache | draft | margin | need | usable | fits |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for s in rows:
        out.append(f"| {GPUS[s.gpu].label} | {s.gpus_per_node} x {s.nodes} | {s.tp} x {s.pp} | {gib(s.weights)} | "
                   f"{gib(s.kv_cache)} | {gib(s.draft)} | {gib(s.margin)} | {gib(s.need)} | {gib(s.usable)} | "
                   f"{'yes' if s.fits else 'no'} |")
    return out


def readme(source: Artifact, name: str, label: str, model: Loadable, sizing: Sizing, launch: Launch,
           record: dict, draft: Artifact | None = None) -> str:
    runs = " ".join(s.run for s in launch.steps)
    needs = ([f"`{HEAD[1:]}` to node 0's address"] if HEAD in runs else []) + \
        ([f"`NODE0`..`NODE{sizing.nodes - 1}` to the nodes' host names"] if "$NODE0" in runs else [])
    lines = [f"# {source.name} on {label}", "",
             f"Written by `llmq deploy` from {source.ref} ({source.kind}, id {source.id[:12]}).", "",
             "## What to run where", "",
             f"Copy the artifact {source.ref} (its directory, {source.path}) to the same path on every node and set "
             f"`MODEL_DIR` to it; set `DEPLOY_DIR` to this directory." if launch.files else
             f"Copy the artifact {source.ref} (its directory, {source.path}) to the same path on every node and set "
             "`MODEL_DIR` to it.",
             *([f"Copy the draft model's artifact {draft.ref} (its directory, {draft.path}) there too and set "
                f"`{DRAFT_DIR[1:]}` to it."] if draft else []),
             *([f"Set {' and '.join(needs)}."] if needs else []), ""]
    for step in launch.steps:
        lines += [f"On {step.where}:", "", "```sh", step.run, "```", ""]
    if launch.instead:
        lines += [f"Or, instead, with a cluster manager, from its files here "
                  f"({', '.join(f'`{f}`' for f in sorted(launch.files))}: the same arguments and layout):", ""]
        for step in launch.instead:
            lines += [f"On {step.where}:", "", "```sh", step.run, "```", ""]
    else:
        lines += ["KServe and Ray Serve configurations are written for `--engine vllm` only.", ""]
    url = f"http://HOST:{record['port']}"
    lines += [f"It serves the OpenAI API on port {record['port']} of node 0 (HOST). Check that it computes what llmq "
              f"evaluated with `llmq deploy verify {name} --endpoint {url}` (the same tasks and KL divergence, through "
              f"the endpoint and in llmq, compared within their 95% intervals; exit 1 when they differ) and its speed "
              f"with `llmq bench serve --endpoint {url}`.",
              "", "## Sizing", "",
              f"Per GPU: weights ({model.weight_bytes / 2**30:.2f} GiB in all, split over tp x pp ranks) + KV cache "
              f"({record['max_concurrency']} sequences x {record['max_seq_len']} tokens, "
              f"{'FP8' if model.kv_fp8 else '16-bit'}) + "
              + (f"the draft model ({gib(sizing.draft)}: its weights and its 16-bit KV cache for the same sequences, "
                 "counted whole on every GPU, the bound whichever way the engine splits it) + " if draft else "")
              + f"{gib(ACTIVATION_MARGIN)} margin for activations and CUDA graphs, against {MEMORY_FRACTION:.0%} of "
              "the GPU's memory.", "",
              *record["table"],
              *[f"No layout fits on {GPUS[g].label}." for g, s in record["smallest_per_gpu"].items() if s is None],
              "",
              "## Flags and what was checked", "",
              *[f"- {n[0].upper()}{n[1:]}." for n in record["notes"]],
              "- Speculative decoding: " + _speculative_line(record["speculative"]),
              "- KV cache: " + ("FP8 with the calibrated scales the checkpoint carries." if model.kv_fp8 else
                                "the model dtype (no calibrated FP8 KV scales in this artifact)."),
              f"- {record['checked'][0].upper()}{record['checked'][1:]}.",
              f"- `{MODEL_DIR}` stands for the source artifact's directory"
              + (f", `{DRAFT_DIR}` for the draft's" if draft else "") + "; nothing here has been run by llmq.", ""]
    return "\n".join(lines)


def _speculative_line(sp: dict | None) -> str:
    if sp is None:
        return "off (`llmq deploy --speculative ngram|REF` asks for it)."
    what = ("prompt lookup (ngram)" if sp["draft"] is None else
            f"the draft model {sp['draft']['ref']} ({sp['draft']['kind']}, tokenizer checked against the target's)")
    return f"{what}, {sp['num_speculative_tokens']} draft tokens a step, in the engine's own configuration above."
