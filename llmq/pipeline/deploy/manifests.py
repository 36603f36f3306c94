"""A vLLM deployment as cluster managers take it: a KServe `LLMInferenceService` (Kubernetes, KServe's llm-d
integration) and a Ray Serve LLM application config. Both carry the launch commands' own vLLM arguments and layout
(engines.py passes them in), so the three forms cannot disagree. Field names are checked against KServe's CRD schema
and Ray's pydantic models (tests/data/deploy_serving_schemas.json, tests/test_deploy.py).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import yaml

from .sizing import GPUS

if TYPE_CHECKING:
    from .sizing import Sizing

KSERVE_FILE = "kserve-llminferenceservice.yaml"
RAY_FILE = "ray-serve-llm.yaml"
KSERVE_MODEL_DIR = "/mnt/models"   # where KServe's storage initializer puts spec.model.uri (its vLLM presets' path)
# the image whose vLLM version the flag names were checked against (tests/data/deploy_engine_flags.json)
VLLM_IMAGE = "vllm/vllm-openai:v0.33.0"
# KServe selects a preset LLMInferenceServiceConfig by this name for a worker with pipeline parallelism but ships
# none (kserve commit aaac4e29: config/llmisvcconfig has only data-parallel worker presets); the manifest defines an
# empty one, since its own template and worker carry the whole commands
PIPELINE_PRESET = "kserve-config-llm-worker-pipeline-parallel"


def k8s_name(name: str) -> str:
    """A DNS-1123 label (what metadata.name accepts) from an artifact name."""
    return re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")[:63].rstrip("-") or "llmq"


def _pod(command: str, gpus: int, port: int | None) -> dict:
    return {"containers": [{"name": "main", "image": VLLM_IMAGE, "command": ["/bin/bash", "-c", command],
                            **({"ports": [{"containerPort": port, "protocol": "TCP"}]} if port else {}),
                            "resources": {k: {"nvidia.com/gpu": gpus} for k in ("limits", "requests")}}]}


def kserve(name: str, model_uri: str, leader: str, worker: str | None, s: Sizing, port: int) -> str:
    """One LLMInferenceService (v1alpha1): a pod of tp GPUs a node; with several nodes a LeaderWorkerSet of
    `pipeline` pods, the leader running `leader` (Ray head + vllm serve) and the others `worker` (Ray workers)."""
    spec = {"model": {"uri": model_uri, "name": name}, "replicas": 1,
            "parallelism": {"tensor": s.tp, **({"pipeline": s.pp} if s.nodes > 1 else {})},
            "router": {"route": {}}, "template": _pod(leader, s.gpus_per_node, port)}
    docs, head = [], ""
    if s.nodes > 1:
        head = (f"# {PIPELINE_PRESET}: KServe looks this preset up for a worker with pipeline\n# parallelism and "
                "ships none; this empty one lets the service below resolve (its template\n# and worker carry the "
                "whole commands).\n")
        spec["worker"] = _pod(worker, s.gpus_per_node, None)
        docs.append({"apiVersion": "serving.kserve.io/v1alpha1", "kind": "LLMInferenceServiceConfig",
                     "metadata": {"name": PIPELINE_PRESET}, "spec": {}})
    docs.append({"apiVersion": "serving.kserve.io/v1alpha1", "kind": "LLMInferenceService",
                 "metadata": {"name": k8s_name(name)}, "spec": spec})
    return head + yaml.safe_dump_all(docs, sort_keys=False)


def ray_serve(name: str, model_source: str, engine_kwargs: dict, s: Sizing, max_concurrency: int) -> str:
    """A `serve run` config: one OpenAI app (ray.serve.llm:build_openai_app), one replica of tp x pp GPU bundles,
    packed onto one node or spread over the Ray cluster's nodes."""
    llm = {"model_loading_config": {"model_id": name, "model_source": model_source},
           "accelerator_type": GPUS[s.gpu].ray, "engine_kwargs": engine_kwargs,
           "deployment_config": {"num_replicas": 1, "max_ongoing_requests": max_concurrency},
           "placement_group_config": {"bundle_per_worker": {"GPU": 1},
                                      "strategy": "STRICT_PACK" if s.nodes == 1 else "PACK"}}
    app = {"name": k8s_name(name), "route_prefix": "/", "import_path": "ray.serve.llm:build_openai_app",
           "args": {"llm_configs": [llm]}}
    return yaml.safe_dump({"applications": [app]}, sort_keys=False)
