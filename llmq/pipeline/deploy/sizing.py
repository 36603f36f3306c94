"""How many GPUs an engine needs for an artifact: llmq's own memory arithmetic, per GPU kind.

Per GPU: the weights (the artifact's stored tensors as `CheckpointReader.runtime_bytes` counts them, or the GGUF file,
split evenly over the tp x pp ranks, as the bundled runtime's worker splits them) + the KV cache of `concurrency`
sequences of `context` tokens (`ModelSpec.kv_bytes_per_token` at the rank's tensor-parallel share, for the rank's
pipeline stage's layers) + a draft model's weights and KV cache where speculative decoding runs one (whole on every
GPU: vLLM shards a draft over the target's tensor-parallel ranks by default (draft_tensor_parallel_size), llama.cpp
splits its layers over the GPUs, SGLang's and TensorRT-LLM's split was not checked; the whole draft is the bound that
holds for all four) + an activation margin,
against the card's memory times the fraction the launch commands give the engine. Engines' own docs leave this to
trial ("add GPUs until it fits"); llmq knows the bytes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from ...errors import LlmqError

if TYPE_CHECKING:
    from ...models.spec import ModelSpec


@dataclass(frozen=True)
class GPU:
    label: str
    memory_mib: int   # total memory as nvidia-smi reports it
    ray: str          # Ray's accelerator_type (ray.util.accelerators): A100s are "A100", the label Ray puts on nodes


GPUS = {g: GPU(label, mib, ray) for g, label, mib, ray in (
    ("h100", "H100 80GB", 81559, "H100"), ("h200", "H200 141GB", 143771, "H200"),
    ("a100-40gb", "A100 40GB", 40960, "A100"), ("a100-80gb", "A100 80GB", 81920, "A100"),
    ("l40s", "L40S 48GB", 46068, "L40S"), ("b200", "B200 180GB", 183359, "B200"),
)}
# the share of each GPU the launch commands hand the engine (vLLM --gpu-memory-utilization, SGLang
# --mem-fraction-static, TensorRT-LLM --kv_cache_free_gpu_memory_fraction, as their defaults ~0.9 do)
MEMORY_FRACTION = 0.9
# per GPU, beyond weights and KV cache: CUDA context, CUDA graphs, the activations of one scheduled step
ACTIVATION_MARGIN = 2 * 2**30
GPUS_PER_NODE = (1, 2, 4, 8)   # tensor-parallel sizes: make_plan's
MAX_NODES = 8


@dataclass(frozen=True)
class Sizing:
    """One layout's memory per GPU, in bytes."""

    gpu: str
    gpus_per_node: int
    nodes: int
    tp: int
    pp: int
    weights: int
    kv_cache: int
    margin: int
    usable: int
    draft: int = 0   # a draft model's weights and KV cache

    @property
    def need(self) -> int:
        return self.weights + self.kv_cache + self.draft + self.margin

    @property
    def fits(self) -> bool:
        return self.need <= self.usable

    @property
    def flags(self) -> str:
        return f"--gpu {self.gpu} --gpus-per-node {self.gpus_per_node} --nodes {self.nodes}"

    def to_dict(self) -> dict:
        return asdict(self) | {"need": self.need, "fits": self.fits}


@dataclass(frozen=True)
class Load:
    """What one engine will hold for a model, independent of the layout."""

    spec: ModelSpec
    weight_bytes: int        # all ranks together
    kv_element_bytes: int    # 1 with an FP8 cache, else the 16-bit compute dtype's 2
    context: int             # tokens per sequence
    concurrency: int         # sequences at once
    draft: int = 0           # per GPU: a draft model's weights and its 16-bit KV cache for the same sequences


def size(load: Load, gpu: str, gpus_per_node: int, nodes: int, tp: int, pp: int) -> Sizing:
    """The memory per GPU of `load` split over tp x pp ranks."""
    spec = load.spec
    layers_per_stage = -(-spec.num_layers // pp)
    kv = spec.kv_bytes_per_token(load.kv_element_bytes, tp) * layers_per_stage / spec.num_layers
    return Sizing(gpu=gpu, gpus_per_node=gpus_per_node, nodes=nodes, tp=tp, pp=pp,
                  weights=-(-load.weight_bytes // (tp * pp)),
                  kv_cache=int(kv * load.context * load.concurrency), margin=ACTIVATION_MARGIN,
                  usable=int(GPUS[gpu].memory_mib * 2**20 * MEMORY_FRACTION), draft=load.draft)


def splits(spec: ModelSpec, tp: int, pp: int) -> str | None:
    """Why the model cannot be split tp x pp (None: it can): tp must divide the heads as the sharding plan does
    without padding (the engines shard the checkpoint themselves and pad nothing), pp at most the layers."""
    from ...models.sharding import make_plan

    if pp > spec.num_layers:
        return f"{pp} pipeline stages exceed the model's {spec.num_layers} layers"
    try:
        make_plan(spec, tp, pad_heads=False)
    except LlmqError as e:
        return str(e)
    return None


def smallest(load: Load, gpu: str, to_ranks, gpus_per_node: int | None = None,
             nodes: int | None = None) -> Sizing | None:
    """The fitting layout with the fewest GPUs (then nodes) on `gpu`, within what the caller fixed;
    `to_ranks(gpus_per_node, nodes)` -> (tp, pp) is the engine's rule, None where it cannot run that layout."""
    layouts = sorted(((g, n) for g in GPUS_PER_NODE for n in range(1, MAX_NODES + 1)
                      if gpus_per_node in (None, g) and nodes in (None, n)), key=lambda gn: (gn[0] * gn[1], gn[1]))
    for g, n in layouts:
        ranks = to_ranks(g, n)
        if ranks is None or splits(load.spec, *ranks):
            continue
        s = size(load, gpu, g, n, *ranks)
        if s.fits:
            return s
    return None


def choose(load: Load, gpu: str, to_ranks, gpus_per_node: int | None, nodes: int | None) -> Sizing:
    """The layout the user fixed (checked), or the smallest that fits; an LlmqError in one line where none does."""
    if gpus_per_node is not None and nodes is not None:
        ranks = to_ranks(gpus_per_node, nodes)
        if ranks is None:
            raise LlmqError(f"--gpus-per-node {gpus_per_node} --nodes {nodes}: this engine runs on one node here")
        if why := splits(load.spec, *ranks):
            raise LlmqError(f"--gpus-per-node {gpus_per_node} --nodes {nodes} (tp {ranks[0]}, pp {ranks[1]}): {why}")
        s = size(load, gpu, gpus_per_node, nodes, *ranks)
        if s.fits:
            return s
        other = smallest(load, gpu, to_ranks)
        draft = f" + draft {gib(s.draft)}" if s.draft else ""
        raise LlmqError(f"{s.flags} does not fit: {gib(s.need)} per GPU (weights {gib(s.weights)} + KV cache "
                        f"{gib(s.kv_cache)}{draft} + margin {gib(s.margin)}) > {gib(s.usable)} usable on one "
                        f"{GPUS[gpu].label}; " + (f"the smallest layout that fits is {other.flags}" if other else
                                                  "no layout fits: lower --max-seq-len or --max-concurrency"))
    s = smallest(load, gpu, to_ranks, gpus_per_node, nodes)
    if s is None:
        fixed = " ".join(f"--{k} {v}" for k, v in (("gpus-per-node", gpus_per_node), ("nodes", nodes)) if v)
        other = smallest(load, gpu, to_ranks) if fixed else None
        raise LlmqError(f"no layout {('with ' + fixed + ' ') if fixed else ''}fits on {GPUS[gpu].label} GPUs "
                        f"(at most {GPUS_PER_NODE[-1]} per node, {MAX_NODES} nodes); "
                        + (f"the smallest that fits is {other.flags}" if other else
                           "lower --max-seq-len or --max-concurrency, or quantize the weights"))
    return s


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"
