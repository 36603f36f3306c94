"""A store for the report tests, in a second: the manifests (config, metrics, command) and report files that a real
run wrote, replayed into fresh artifacts with the same parents. The run (tests/data/report_store.json; how it was
made: `python tests/report_store.py capture OUT.json`) quantized a tiny Llama with mixed precision and a tiny
Qwen3-MoE with GPTQ, evaluated the first (math, code, kld, with gates), swept the MoE offline and load-tested the
first behind `llmq serve`; its payloads are replaced by files of the recorded sizes, which the report never reads."""

from __future__ import annotations

import json
import sys
from pathlib import Path

DATA = Path(__file__).with_name("data") / "report_store.json"
HOSTILE = "<script>window.__pwned=1</script><img src=x onerror=\"window.__pwned=2\">\"'&amp;"


def replay(store, data: list[dict] | None = None) -> list:
    """The recorded artifacts written into `store`, in order (parents before children)."""
    data = json.loads(DATA.read_text()) if data is None else data
    arts = []
    for rec in data:
        with store.create(rec["kind"], rec["name"], parents=[arts[i].id for i in rec["parents"]],
                          config=rec["config"], command=rec["command"]) as w:
            for name, text in rec["files"].items():
                (w.dir / name).write_text(text)
            if not rec["files"]:
                (w.dir / "payload.bin").write_bytes(bytes(rec["metrics"].get("size_bytes", 16)))
            w.metrics.update(rec["metrics"])
        arts.append(w.artifact)
    return arts


def hostile(data: list[dict] | None = None) -> list[dict]:
    """The recorded data with HOSTILE in every string the report shows that an artifact or a server provides: the
    commands, the mixed-precision schemes, the expert-coverage scheme, the eval's task names, model names and gate
    texts, the served model name of the load test."""
    data = json.loads(DATA.read_text()) if data is None else data
    for rec in data:
        rec["command"] = f"llmq quantize {HOSTILE}"
        mixed = rec["config"].get("mixed_precision")
        if mixed:
            mixed["units"][0]["scheme"] = HOSTILE
            mixed["count"] = {HOSTILE: 1, **mixed["count"]}
        if rec["config"].get("expert_coverage"):
            rec["config"]["expert_coverage"]["scheme"] = HOSTILE
        if rec["kind"] == "quantized" and "scheme" in rec["config"]:
            rec["config"]["scheme"] = HOSTILE
        if "report.json" in rec["files"]:
            rep = json.loads(rec["files"]["report.json"])
            if "deltas" in rep:
                rep["deltas"][HOSTILE] = next(iter(rep["deltas"].values()))
                rep["evaluated"]["name"] = rep["baseline"]["name"] = HOSTILE
                for g in rep["gates"]:
                    g["what"] = HOSTILE
            if "settings" in rep and "model" in rep["settings"]:
                rep["settings"]["model"] = HOSTILE
            rec["files"]["report.json"] = json.dumps(rep)
    return data


def capture(out: Path) -> None:
    """Run the real pipeline on tiny random models (a minute or two) and record what the artifacts hold."""
    import tempfile

    from helpers import live_server, make_tiny_model

    from llmq.artifacts import Store
    from llmq.bench import report as R
    from llmq.bench import run_offline
    from llmq.bench.offline import OfflineOptions
    from llmq.bench.online import OnlineSettings, parent_ids, run_online
    from llmq.evals.evaluate import run_eval
    from llmq.evals.gate import parse_gates
    from llmq.evals.runner import EvalSettings
    from llmq.models import resolve_model
    from llmq.pipeline.quantize import QuantizeOptions, quantize
    from llmq.runtime import EngineConfig

    d = Path(tempfile.mkdtemp())
    store = Store(d / "store")
    src = resolve_model(str(make_tiny_model(d / "tiny", seed=3)), store)
    mixed = quantize(src, QuantizeOptions(method="rtn", bits=4, group_size=32, target_bpw=6, num_samples=2,
                                          seq_len=64, probe_tokens=256), store, progress=False)
    moe = resolve_model(str(make_tiny_model(d / "moe", seed=7, model_type="qwen3_moe", head_dim=16, num_experts=8,
                                            num_experts_per_tok=2, moe_intermediate_size=32)), store)
    gptq = quantize(moe, QuantizeOptions(method="gptq", bits=4, group_size=32, num_samples=2, seq_len=32,
                                         probe_tokens=128), store, progress=False)
    ev = run_eval(store, mixed, src, EvalSettings(tasks=["math", "code", "kld"], limit=8, seed=1),
                  parse_gates("math>=-20,code>=-10,kld<=0.5")).artifact
    offline = run_offline(gptq, OfflineOptions(batch_sizes=[1, 2, 4], input_len=8, output_len=4), store)
    cfg = EngineConfig(max_num_seqs=4, max_model_len=128, kv_cache_memory=8 << 20)
    with live_server(mixed.path, cfg, name="tiny") as live:
        rep, ep = run_online(OnlineSettings(endpoint=live.url, concurrency=[1, 2, 4], num_prompts=8, input_len=16,
                                            output_len=8), store, print)
        online = R.save(store, rep, "bench-tiny-online", parent_ids(ep, store))
    index, out_data = {}, []
    for a in (src, mixed, moe, gptq, ev, offline, online):
        index[a.id] = len(out_data)
        out_data.append({"kind": a.kind, "name": a.name, "parents": [index[p] for p in a.parents],
                         "command": a.manifest.get("command"), "config": a.config, "metrics": a.metrics,
                         "files": {n: a.file(n).read_text() for n in ("report.json",) if (a.path / n).is_file()}})
    out.write_text(json.dumps(out_data, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__" and sys.argv[1:2] == ["capture"]:
    capture(Path(sys.argv[2]))
