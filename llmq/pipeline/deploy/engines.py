"""The four serving engines `llmq deploy` writes for: what each loads, how it spreads over GPUs and nodes, and its
launch commands. Each engine is one `Engine` below; the stage looks them up in ENGINES and never branches on a name.

Flags are emitted only where the artifact supports them: an FP8 KV cache only with calibrated FP8 scales (an
uncalibrated one would run with scale 1.0, sglang#18818); never `--quantization` for a compressed-tensors checkpoint
(the engines read its quantization_config; forcing a method is how "unknown quantization method" happens). Speculative
decoding only where the user asked for it (`--speculative ngram|REF`): the engine's own prompt lookup, or a draft model
it loads as it loads a target.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from ...errors import LlmqError
from . import manifests
from .sizing import MEMORY_FRACTION

if TYPE_CHECKING:
    from ...artifacts import Artifact, Store
    from ...models.spec import ModelSpec
    from .sizing import Sizing

MODEL_DIR = "$MODEL_DIR"   # the source artifact's directory, copied to the same path on every node
DRAFT_DIR = "$DRAFT_DIR"   # the draft model's artifact directory, copied to the same path on every node
HEAD = "$HEAD_IP"          # node 0's address, reachable from the other nodes
DEPLOY_DIR = "$DEPLOY_DIR"  # the deploy artifact's directory
# the variables the commands leave to the shell that runs them; every other character of a word is quoted
_VARIABLE = re.compile(r"\$(?:MODEL_DIR|DRAFT_DIR|HEAD_IP|DEPLOY_DIR|LWS_LEADER_ADDRESS|NODE\d+)(?![A-Za-z0-9_])")
# the file names (relative paths) of an artifact that reach a command line: no shell syntax, no option, no `..`
_SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*(?:/[A-Za-z0-9_][A-Za-z0-9_.+-]*)*")


@dataclass(frozen=True)
class Loadable:
    """What an engine will load from an artifact."""

    model: str               # the path it loads, under the source artifact's directory ("" for the directory)
    spec: ModelSpec
    weight_bytes: int        # all ranks together
    kv_fp8: bool             # calibrated FP8 KV-cache scales the engine will apply
    notes: tuple[str, ...] = ()

    @property
    def path(self) -> str:
        return self.under(MODEL_DIR)

    def under(self, directory: str) -> str:
        """The path it loads where the source artifact's directory is `directory`."""
        return f"{directory}/{self.model}" if self.model else directory


@dataclass(frozen=True)
class Speculation:
    """Speculative decoding the user asked for: prompt lookup (no draft) or a draft model, which the engine loads as
    it loads a target (`Engine.load`) from DRAFT_DIR."""

    k: int                          # draft tokens per step (--num-speculative-tokens)
    draft: Loadable | None = None

    @property
    def draft_path(self) -> str:
        return self.draft.under(DRAFT_DIR)


def _lookup() -> tuple[int, int]:
    """The n-gram lengths llmq's own prompt lookup matches (longest first), which the engines are given too."""
    from ...runtime.speculative import NGRAM_MAX, NGRAM_MIN

    return NGRAM_MAX, NGRAM_MIN


@dataclass(frozen=True)
class Step:
    where: str   # which machine(s) run it
    run: str     # the command line


@dataclass(frozen=True)
class Launch:
    steps: list[Step]
    files: dict[str, str] = field(default_factory=dict)   # name -> text, written into the deploy artifact
    instead: list[Step] = field(default_factory=list)     # other ways to run the same (a cluster manager's files)
    notes: tuple[str, ...] = ()                           # what the README says of the commands


@dataclass(frozen=True)
class Engine:
    name: str
    label: str
    load: Callable[[Artifact, Store], Loadable]
    # (gpus per node, nodes) -> (tp, pp), or None where the engine does not run that layout
    to_ranks: Callable[[int, int], tuple[int, int] | None]
    # dict: the deploy options that reach the command line, "speculation" a Speculation or None
    launch: Callable[[Loadable, Sizing, dict], Launch]
    checked: str                                          # how its flag names were checked
    port: int


class _Op(str):
    """A shell operator between words (`&&`, `|`, `<`, `>`), written as it is."""


class _Verbatim(str):
    """A word whose `$NAME`s reach the program unexpanded (envsubst's list of variables)."""


def _quote(word: str) -> str:
    """One shell word: the variables in _VARIABLE in double quotes (expanded, never split), the rest single-quoted
    where it needs quoting, so that no name an artifact carries can run as shell syntax."""
    if isinstance(word, _Op):
        return word
    if isinstance(word, _Verbatim):
        return shlex.quote(word)
    parts, at = [], 0
    for m in _VARIABLE.finditer(word):
        parts += [shlex.quote(word[at:m.start()]) if m.start() > at else "", f'"{m[0]}"']
        at = m.end()
    return "".join(parts) + (shlex.quote(word[at:]) if at < len(word) or not parts else "")


def _cmd(*parts) -> str:
    """A command line from words and (flag, value) pairs; a None value drops its flag, a dict value is JSON. The one
    place commands are rendered: every word goes through _quote."""
    words = []
    for p in parts:
        if isinstance(p, tuple):
            if p[1] is not None:
                value = json.dumps(p[1]) if isinstance(p[1], dict) else str(p[1])
                words += [p[0]] + ([] if p[1] is True else [value])
        else:
            words.append(p)
    return " ".join(map(_quote, words))


def _safe_name(art: Artifact, name: str) -> str:
    """A file name an engine.json records, refused unless in _SAFE_NAME: it is written into shell commands, and
    anyone who can write a shared store can reseal a manifest around any name."""
    if not _SAFE_NAME.fullmatch(name):
        raise LlmqError(f"{art.ref} names the file {name!r}, outside the safe set for a command line (letters, "
                        "digits, '_', '.', '+', '-' and '/' between them); rebuild it with llmq build")
    return name


def _hf_checkpoint(art: Artifact, model: str = "", kv_fp8: bool | None = None, notes=()) -> Loadable:
    """A Hugging Face checkpoint under `art` (dense, compressed-tensors or bitsandbytes): its stored bytes, its KV
    scales."""
    import torch

    from ...models.reader import CheckpointReader

    src = CheckpointReader(art.path / model)
    if src.embedding_quantized():
        raise LlmqError(f"{art.ref} stores an INT8 embedding table (`llmq quantize --embedding int8`), which the "
                        "serving engines do not load; quantize again with a 16-bit one "
                        "(`llmq quantize --embedding keep`)")
    qc = src.qconfig
    odd = {w.num_bits for w in ([qc.weights, *qc.modules.values()] if qc else ())
           if w is not None and w.type == "int"} - {4, 8}
    if odd:
        raise LlmqError(f"{art.ref} has {max(odd)}-bit integer weights, which vLLM and SGLang do not run (4 and 8 "
                        "bits only); `llmq build --target gguf` for llama-server, serve it with llmq, or quantize "
                        "again (`llmq quantize --bits 4` or 8)")
    kv = src.kv_cache_dtype()
    notes = list(notes)
    if kv == "int8":
        notes.append("the artifact's INT8 KV-cache scales are not used: these engines have no INT8 KV cache; the "
                     "cache is sized and run in 16 bits")
    if src.qconfig is not None and src.qconfig.weights is not None:
        notes.append("weights pre-quantized (compressed-tensors): no --quantization flag, the engine reads the "
                     "checkpoint's quantization_config")
    return Loadable(model, src.spec, src.runtime_bytes(torch.bfloat16), kv == "fp8" if kv_fp8 is None else kv_fp8,
                    tuple(notes))


def _what(art: Artifact, engine) -> str:
    return f"a {engine.target} engine" if engine else f"{'an' if art.kind[0] in 'aeiou' else 'a'} {art.kind} artifact"


def _engine_spec(art: Artifact):
    from ...models.engine_spec import EngineSpec

    return EngineSpec.read(art.path)


def _hf_artifact(engine: str):
    """vLLM and SGLang load a model or quantized artifact as it is."""
    def load(art: Artifact, store: Store) -> Loadable:
        if art.kind not in ("model", "quantized"):
            spec = _engine_spec(art) if art.kind == "engine" else None
            raise LlmqError(f"{art.ref} is {_what(art, spec)}; {engine} loads a model or quantized artifact (a Hugging "
                            "Face checkpoint)" + (f": deploy {spec.source['name']}, the artifact it was built from"
                                                  if spec else ""))
        return _hf_checkpoint(art)
    return load


def _load_trtllm(art: Artifact, store: Store) -> Loadable:
    """trtllm-serve loads a dense checkpoint or `llmq build --target trtllm`'s (an engine built for the removed
    TensorRT engine builder, recorded without an `hf_checkpoint`, is not one)."""
    if art.kind == "model":
        return _hf_checkpoint(art)
    engine = _engine_spec(art) if art.kind == "engine" else None
    if engine is None or engine.target != "trtllm" or "hf_checkpoint" not in engine.outputs:
        old = " for the removed engine builder" if engine and engine.target == "trtllm" else ""
        raise LlmqError(f"{art.ref} is {_what(art, engine)}{old}; trtllm-serve loads a dense model or a trtllm engine: "
                        f"run `llmq build {engine.source['name'] if engine else art.name} --target trtllm`")
    return _hf_checkpoint(art, _safe_name(art, engine.outputs["hf_checkpoint"]), kv_fp8=engine.kv_cache_dtype == "fp8",
                          notes=["quantization and KV-cache scheme from the checkpoint's hf_quant_config.json"])


def _load_gguf(art: Artifact, store: Store) -> Loadable:
    """llama-server loads `llmq build --target gguf`'s file; the model's shape is its source's config."""
    from ...models.spec import ModelSpec

    engine = _engine_spec(art) if art.kind == "engine" else None
    if engine is None or engine.target != "gguf":
        raise LlmqError(f"{art.ref} is {_what(art, engine)}; llama-server loads a GGUF file: run "
                        f"`llmq build {engine.source['name'] if engine else art.name} --target gguf`")
    gguf = _safe_name(art, engine.outputs["gguf"]["file"])
    spec = ModelSpec.from_config(store.by_id(engine.source["id"]).path)
    return Loadable(gguf, spec, (art.path / gguf).stat().st_size, kv_fp8=False,
                    notes=("llama.cpp keeps the KV cache in f16 (its default -ctk / -ctv)",))


def _across_nodes(g: int, n: int) -> tuple[int, int]:
    """Tensor parallel within a node, pipeline parallel across nodes (the engines' multi-node advice)."""
    return g, n


def _one_node(g: int, n: int) -> tuple[int, int] | None:
    """llama.cpp: one node, its GPUs splitting the layers (--split-mode layer), no tensor parallelism."""
    return (1, g) if n == 1 else None


def _vllm_speculative(sp: Speculation | None) -> dict | None:
    """vLLM's SpeculativeConfig (vllm/config/speculative.py): prompt lookup over llmq's n-gram lengths, or a draft
    model (method draft_model; its tensor parallelism defaults to the target's)."""
    if sp is None:
        return None
    if sp.draft is None:
        longest, shortest = _lookup()
        return {"method": "ngram", "num_speculative_tokens": sp.k, "prompt_lookup_max": longest,
                "prompt_lookup_min": shortest}
    return {"method": "draft_model", "model": sp.draft_path, "num_speculative_tokens": sp.k}


def vllm_args(m: Loadable, s: Sizing, o: dict) -> dict:
    """vLLM's engine arguments for a layout by their Python names: the `vllm serve` flags, and Ray Serve's
    engine_kwargs, are both spelled from this."""
    args = {"tensor_parallel_size": s.tp, "pipeline_parallel_size": s.pp if s.nodes > 1 else None,
            "max_model_len": o["max_seq_len"], "max_num_seqs": o["max_concurrency"],
            "gpu_memory_utilization": MEMORY_FRACTION, "kv_cache_dtype": "fp8" if m.kv_fp8 else None,
            "speculative_config": _vllm_speculative(o["speculation"])}
    return {k: v for k, v in args.items() if v is not None}


_RAY_HEAD = ("ray", "start", "--head", ("--port", 6379))


def _ray_worker(head: str) -> tuple:
    return "ray", "start", ("--address", f"{head}:6379"), "--block"


def _launch_vllm(m: Loadable, s: Sizing, o: dict) -> Launch:
    def serve(model_dir: str) -> tuple:
        return ("vllm", "serve", m.under(model_dir), ("--served-model-name", o["served_name"]),
                *((f"--{k.replace('_', '-')}", v) for k, v in vllm_args(m, s, o).items()),
                ("--distributed-executor-backend", "ray" if s.nodes > 1 else None),
                ("--host", "0.0.0.0"), ("--port", 8000))

    multi = s.nodes > 1
    draft = o["speculation"] is not None and o["speculation"].draft is not None
    files, instead, notes = {}, [], ()
    if draft:   # the service's storage initializer fetches spec.model.uri only
        notes = ("no KServe manifest with a draft model: an LLMInferenceService fetches one model (spec.model.uri), "
                 "and the draft's would need a volume llmq does not write",)
    else:
        in_pod = serve(manifests.KSERVE_MODEL_DIR)
        files[manifests.KSERVE_FILE] = manifests.kserve(
            o["served_name"], "$MODEL_URI", _cmd(*_RAY_HEAD, _Op("&&"), *in_pod) if multi else _cmd(*in_pod),
            _cmd(*_ray_worker("$LWS_LEADER_ADDRESS")) if multi else None, s, 8000)
        instead.append(Step("a Kubernetes cluster with KServe's LLMInferenceService (llm-d) and, for several nodes, "
                            "LeaderWorkerSet; `MODEL_URI` set to where it reads the artifact (hf://, s3://, pvc://)",
                            _cmd("envsubst", _Verbatim("$MODEL_URI"), _Op("<"), f"{DEPLOY_DIR}/{manifests.KSERVE_FILE}",
                                 _Op("|"), "kubectl", "apply", "-f", "-")))
    files[manifests.RAY_FILE] = manifests.ray_serve(o["served_name"], m.path, vllm_args(m, s, o), s,
                                                    o["max_concurrency"])
    dirs = f"{MODEL_DIR} {DRAFT_DIR}" if draft else MODEL_DIR
    instead.append(Step("node 0 of the Ray cluster above (in place of `vllm serve`), with `ray[serve,llm]` installed"
                        if multi else "the node, with `ray[serve,llm]` installed (Ray Serve LLM)",
                        _cmd("envsubst", _Verbatim(dirs), _Op("<"), f"{DEPLOY_DIR}/{manifests.RAY_FILE}", _Op(">"),
                             "serve.yaml", _Op("&&"), "serve", "run", "serve.yaml")))
    if not multi:
        return Launch([Step("the node", _cmd(*serve(MODEL_DIR)))], files, instead, notes)
    workers = "node 1" if s.nodes == 2 else f"nodes 1..{s.nodes - 1}"
    return Launch([Step("node 0", _cmd(*_RAY_HEAD)), Step(workers, _cmd(*_ray_worker(HEAD))),
                   Step("node 0, once `ray status` shows every GPU", _cmd(*serve(MODEL_DIR)))], files, instead, notes)


def _sglang_speculative(sp: Speculation | None) -> list[tuple]:
    """SGLang's speculative flags: NGRAM (its prompt-lookup trie), or STANDALONE (a separate draft model; EAGLE and
    NEXTN need heads trained on the target, which llmq does not make), k draft steps verified as a chain of k + 1
    tokens (the last accepted token and k drafts)."""
    if sp is None:
        return []
    if sp.draft is None:
        return [("--speculative-algorithm", "NGRAM"), ("--speculative-num-draft-tokens", sp.k + 1)]
    return [("--speculative-algorithm", "STANDALONE"), ("--speculative-draft-model-path", sp.draft_path),
            ("--speculative-num-steps", sp.k), ("--speculative-eagle-topk", 1),
            ("--speculative-num-draft-tokens", sp.k + 1)]


def _launch_sglang(m: Loadable, s: Sizing, o: dict) -> Launch:
    def node(rank: int | None) -> str:
        multi = rank is not None
        return _cmd("python", "-m", "sglang.launch_server", ("--model-path", m.path),
                    ("--served-model-name", o["served_name"]), ("--tp-size", s.tp),
                    ("--pp-size", s.pp if multi else None), ("--nnodes", s.nodes if multi else None),
                    ("--node-rank", rank), ("--dist-init-addr", f"{HEAD}:5000" if multi else None),
                    ("--context-length", o["max_seq_len"]), ("--max-running-requests", o["max_concurrency"]),
                    ("--mem-fraction-static", MEMORY_FRACTION), ("--kv-cache-dtype", "fp8_e4m3" if m.kv_fp8 else None),
                    *_sglang_speculative(o["speculation"]), ("--host", "0.0.0.0"), ("--port", 30000))
    if s.nodes == 1:
        return Launch([Step("the node", node(None))])
    return Launch([Step(f"node {r}", node(r)) for r in range(s.nodes)])


TRTLLM_OPTIONS = "trtllm-llm-api-options.yaml"


def _trtllm_speculative(sp: Speculation | None) -> dict | None:
    """The LLM API's speculative_config (tensorrt_llm/llmapi/llm_args.py): NGramDecodingConfig over llmq's longest
    n-gram, or DraftTargetDecodingConfig naming the draft model; both draft a chain of max_draft_len tokens."""
    if sp is None:
        return None
    if sp.draft is None:
        return {"decoding_type": "NGram", "max_draft_len": sp.k, "max_matching_ngram_size": _lookup()[0]}
    return {"decoding_type": "Draft_Target", "max_draft_len": sp.k, "speculative_model": sp.draft_path}


def _launch_trtllm(m: Loadable, s: Sizing, o: dict) -> Launch:
    import yaml

    options = {**({"kv_cache_config": {"dtype": "fp8"}} if m.kv_fp8 else {}),
               **({"speculative_config": spec} if (spec := _trtllm_speculative(o["speculation"])) else {})}
    files = {TRTLLM_OPTIONS: yaml.safe_dump(options, sort_keys=False)} if options else {}
    # the LLM API reads the YAML as it is: one naming $DRAFT_DIR is expanded into a copy on each node first
    expand = DRAFT_DIR in files.get(TRTLLM_OPTIONS, "")
    path = f"/tmp/{TRTLLM_OPTIONS}" if expand else f"{DEPLOY_DIR}/{TRTLLM_OPTIONS}"
    steps = [Step("every node", _cmd("envsubst", _Verbatim(DRAFT_DIR), _Op("<"), f"{DEPLOY_DIR}/{TRTLLM_OPTIONS}",
                                     _Op(">"), path))] if expand else []
    serve = ["trtllm-serve", m.path, ("--backend", "pytorch"), ("--tp_size", s.tp), ("--pp_size", s.pp),
             ("--max_batch_size", o["max_concurrency"]), ("--max_seq_len", o["max_seq_len"]),
             ("--kv_cache_free_gpu_memory_fraction", MEMORY_FRACTION),
             ("--extra_llm_api_options", path if files else None), ("--host", "0.0.0.0"), ("--port", 8000)]
    if s.nodes == 1:
        return Launch([*steps, Step("the node", _cmd(*serve))], files)
    hosts = ",".join(f"$NODE{r}:{s.gpus_per_node}" for r in range(s.nodes))
    return Launch([*steps, Step("node 0 (one MPI world; passwordless ssh to every node, same paths everywhere)",
                                _cmd("mpirun", ("-H", hosts), ("-n", s.tp * s.pp), "trtllm-llmapi-launch", *serve))],
                  files)


def _llama_speculative(sp: Speculation | None) -> list[tuple]:
    """llama-server's speculative flags (common/arg.cpp): ngram-simple (prompt lookup, drafting k tokens;
    its lookup length stays llama.cpp's default), or draft-simple with the draft GGUF on the GPUs too."""
    if sp is None:
        return []
    if sp.draft is None:
        return [("--spec-type", "ngram-simple"), ("--spec-ngram-simple-size-m", sp.k)]
    return [("--spec-type", "draft-simple"), ("-md", sp.draft_path), ("--spec-draft-n-max", sp.k), ("-ngld", 999)]


def _launch_llama(m: Loadable, s: Sizing, o: dict) -> Launch:
    return Launch([Step("the node", _cmd(
        "llama-server", ("-m", m.path), ("-c", o["max_seq_len"] * o["max_concurrency"]),
        ("-np", o["max_concurrency"]), ("-t", o["threads"]), ("-ngl", 999),
        ("--split-mode", "layer" if s.pp > 1 else None), *_llama_speculative(o["speculation"]),
        ("--host", "0.0.0.0"), ("--port", 8080)))])


_WHEEL = ("flag names checked against the argument parser source of the {} wheel (`pip download --no-deps {}`; "
          "tests/data/deploy_engine_flags.json, tests/test_deploy.py)")
ENGINES = {e.name: e for e in (
    Engine("vllm", "vLLM", _hf_artifact("vLLM"), _across_nodes, _launch_vllm,
           _WHEEL.format("vllm 0.33.0", "vllm") + "; the KServe manifest's field paths and types against the "
           "LLMInferenceService CRD's v1alpha1 schema (kserve commit aaac4e29, "
           "config/crd/full/llmisvc/serving.kserve.io_llminferenceservices.yaml), the Ray Serve config's keys "
           "against the ray 2.60.0 wheel's pydantic models (LLMServingArgs, LLMConfig, ModelLoadingConfig, "
           "DeploymentConfig, accelerator names) and its engine_kwargs against the vLLM flags above "
           "(tests/data/deploy_serving_schemas.json); neither was applied to a cluster", 8000),
    Engine("sglang", "SGLang", _hf_artifact("SGLang"), _across_nodes, _launch_sglang,
           _WHEEL.format("sglang 0.5.23", "sglang"), 30000),
    Engine("trtllm", "TensorRT-LLM", _load_trtllm, _across_nodes, _launch_trtllm,
           "flag names from TensorRT-LLM's trtllm-serve documentation, the LLM-API options' speculative_config keys "
           "from tensorrt_llm/llmapi/llm_args.py source read through a code index (tensorrt_llm is not installable "
           "here)", 8000),
    Engine("llama.cpp", "llama.cpp", _load_gguf, _one_node, _launch_llama,
           "flag names checked against llama.cpp's argument table (common/arg.cpp) in the source the llama-cpp-python "
           "0.3.36 sdist vendors (tests/data/deploy_engine_flags.json, tests/test_deploy.py)", 8080),
)}
