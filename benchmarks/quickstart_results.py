"""The README's quickstart figures as JSON (docs/results.json), read from the artifacts the last
`llmq run recipes/quickstart.yaml` left in the store: nothing runs here (a stage not in the store is an error).
tests/test_docs.py fails when a figure the README quotes differs from that file.

    llmq run recipes/quickstart.yaml
    python benchmarks/quickstart_results.py --machine "2-core AMD EPYC" > docs/results.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "quickstart.yaml"


def figures(store, recipe_path: Path = RECIPE) -> dict:
    """Each stage's figures, from the store's artifacts of the recipe (the ones a re-run would reuse)."""
    from llmq.errors import LlmqError
    from llmq.evals.report import REPORT_JSON
    from llmq.pipeline.recipe import load_recipe
    from llmq.pipeline.runner import run_recipe

    stages = {r.stage: r.artifact for r in run_recipe(load_recipe(str(recipe_path)), store, dry_run=True).stages}
    missing = [s for s, art in stages.items() if art is None]
    if missing:
        raise LlmqError(f"no artifact of {', '.join(missing)} in {store.root}: run `llmq run {recipe_path}` first")
    q, kv, build, ev = stages["quantize"], stages["quantize_kv"], stages["build"], stages["eval"]
    plan, report = build.config["plan"], json.loads(ev.file(REPORT_JSON).read_text())
    return {
        "quantize": {"mib": round(sum(f["size"] for f in q.manifest["files"].values()) / 2**20, 1),
                     "ratio_vs_bf16": q.metrics["ratio_vs_bf16"],
                     "linear_ratio_vs_bf16": q.metrics["linear_ratio_vs_bf16"],
                     "kld": q.metrics["probe"]["kld_mean"], "top1": q.metrics["probe"]["top1"]},
        "quantize_kv": {"kld": kv.metrics["probe"]["kld_mean"], "top1": kv.metrics["probe"]["top1"]},
        "build": {"heads": [plan["num_heads"], plan["num_kv_heads"]],
                  "padded_heads": [plan["padded_heads"], plan["padded_kv_heads"]],
                  "max_rel_error": build.metrics["verify"]["max_rel_error"],
                  "tolerance": build.metrics["verify"]["tolerance"]},
        "eval": {**{k: {"delta": d["delta"], "ci95": d["ci95"]} for k, d in report["deltas"].items()
                    if k in ("math", "code")},
                 "kld": report["kld"]["mean"]},
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", help="the artifact store (default: LLMQ_STORE, else llmq's default)")
    p.add_argument("--machine", required=True, help="the machine the recipe ran on, as the README names it")
    p.add_argument("--recipe", default=str(RECIPE), help="the recipe (default: recipes/quickstart.yaml)")
    args = p.parse_args(argv)
    from llmq.artifacts import Store
    from llmq.errors import LlmqError

    store = Store.open(args.store)
    try:
        stages = figures(store, Path(args.recipe))
    except LlmqError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = {"quickstart": {"command": "llmq run recipes/quickstart.yaml", "machine": args.machine,
                          "date": datetime.date.today().isoformat(),
                          "stages": stages}}
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
