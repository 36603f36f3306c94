"""Does the weight-MSE ratio rank the schemes of `quantize --target-bpw --for` as their measured KLDs do?

For a handful of units of the default model (or any model reference) each candidate scheme's KLD is measured directly
(that unit alone in that scheme, the later layers run on the perturbed states: mixed.measure with every scheme
direct) and set beside the estimate the planner uses (the unit's measured INT4 KLD x the ratio of the two schemes'
summed squared weight errors). Prints one row per unit and scheme and, per unit, whether the two orders agree.

    OMP_NUM_THREADS=1 python benchmarks/mixed_scheme_sensitivity.py --layers 2 14 27
"""

from __future__ import annotations

import argparse
import json

from llmq.artifacts import Store
from llmq.models import resolve_model
from llmq.models.load import load_tokenizer
from llmq.pipeline.quantize import QuantizeOptions, mixed
from llmq.pipeline.quantize.calib import load_calibration
from llmq.pipeline.quantize.stage import validate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--layers", type=int, nargs="+", default=[2, 14, 27])
    p.add_argument("--windows", type=int, default=4, help="calibration windows of 256 tokens")
    p.add_argument("--json", help="write the numbers here too")
    a = p.parse_args()
    store = Store.open()
    src = resolve_model(a.model, store)
    opts, spec, _ = validate(src, QuantizeOptions(target_bpw=6, for_engine="llmq"))
    calib = load_calibration(None, load_tokenizer(src.path), a.windows, 256, 0)
    cands = [c for c in mixed.candidates(spec, opts) if c.name != "16bit"]
    got = mixed.measure(src.path, spec, opts, calib, "cpu", True, cands, tuple(c.name for c in cands),
                        layers=tuple(a.layers))
    units = spec.arch.unit_paths()
    rows, agree = [], 0
    for (i, u), m in sorted(got.items()):
        est = {c.name: m["kld"]["int4"] * m["mse"][c.name] / m["mse"]["int4"] for c in cands}
        same = sorted(est, key=est.get) == sorted(m["kld"], key=m["kld"].get)
        agree += same
        print(f"layer {i:2d} {'/'.join(n.split('.')[-1] for n in units[u]):24s} order agrees: {same}")
        for c in cands:
            print(f"    {c.name:6s} measured {m['kld'][c.name]:.6f}  estimated {est[c.name]:.6f}")
            rows.append({"layer": i, "unit": units[u], "scheme": c.name, "measured": m["kld"][c.name],
                         "estimated": est[c.name]})
    print(f"{agree} of {len(got)} units: the estimate orders the schemes as the measurement does "
          f"({calib.tokens} tokens, {len(calib.samples)} windows)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
