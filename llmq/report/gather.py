"""What the report shows of each artifact, read from its family (artifacts/card.py): plain data, one dict per
section, None where the artifact's lineage never measured it (the page says "not measured", with why)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..artifacts import Artifact, Store
from ..artifacts.card import Family, card, read_report
from ..evals.gate import ALIASES, KLD_NAMES, check_gates, parse_gates

MEASURED = "int4"   # the scheme mixed precision measures each unit's KLD at (pipeline/quantize/mixed.py)


@dataclass
class Subject:
    index: int
    art: Artifact
    fam: Family
    card: dict
    gate: str | None = None   # a gate expression to judge its eval with (a recipe's), else the eval's own gates
    why: dict = field(default_factory=dict)   # section -> why it is not measured

    @property
    def letter(self) -> str:
        return chr(65 + self.index)


def subjects(store: Store, arts: list[Artifact], gate: str | None = None, reports=()) -> list[Subject]:
    """Each artifact's data; `reports` go first among its family's reports (write_report says why)."""
    out = []
    for i, a in enumerate(arts):
        fam = Family.of(store, a)
        fam.evals = [r for r in reports if r.kind == "eval-report"] + [e for e in fam.evals if e not in reports]
        fam.benches = [r for r in reports if r.kind == "bench-report"] + [b for b in fam.benches if b not in reports]
        out.append(Subject(i, a, fam, card(store, a, fam), gate))
    return out


def lineage(s: Subject) -> list[dict]:
    return [{"ref": a.ref, "kind": a.kind, "id": a.id, "command": a.manifest.get("command") or "",
             "created": a.manifest.get("created") or ""} for a in s.fam.chain]


def size(s: Subject) -> dict:
    q = s.fam.quantized
    m = q.metrics if q is not None else {}
    return {"bytes": s.art.payload_bytes, "weights_bytes": m.get("size_bytes"), "bf16_bytes": m.get("bf16_bytes"),
            "ratio_vs_bf16": m.get("ratio_vs_bf16"), "linear_ratio_vs_bf16": m.get("linear_ratio_vs_bf16"),
            "from": q.ref if q is not None else None}


def _unit_label(modules: list[str]) -> str:
    return "+".join(m.rsplit(".", 1)[-1] for m in modules)


def bits(s: Subject) -> dict | None:
    """Mixed precision: the scheme and bits of every unit, layers x units; else the one scheme of every linear."""
    q = s.fam.quantized
    if q is None:
        s.why["bits"] = "no quantized artifact in the lineage (16-bit weights)"
        return None
    mixed = q.config.get("mixed_precision")
    if not mixed:
        return {"uniform": q.config.get("scheme") or q.config.get("method"), "from": q.ref}
    units = mixed.get("units") or []
    cols = list(dict.fromkeys(_unit_label(u["modules"]) for u in units))
    layers = 1 + max((u["layer"] for u in units), default=-1)
    grid: list[list] = [[None] * len(cols) for _ in range(layers)]
    names: list[list] = [[""] * len(cols) for _ in range(layers)]
    kld: list[list] = [[None] * len(cols) for _ in range(layers)]
    for u in units:
        j = cols.index(_unit_label(u["modules"]))
        grid[u["layer"]][j] = u.get("bits")
        names[u["layer"]][j] = str(u.get("scheme", ""))
        kld[u["layer"]][j] = (u.get("kld_alone") or {}).get(MEASURED)
    return {"from": q.ref, "units": cols, "bits": grid, "schemes": names, "kld_alone": kld,
            "bpw": mixed.get("bpw"), "target_bpw": mixed.get("target_bpw"), "count": mixed.get("count") or {},
            "estimated_kld": mixed.get("estimated_kld")}


def kld_per_layer(s: Subject, b: dict | None) -> list[float] | None:
    """Each layer's KLD with its units alone rounded to INT4 (mixed precision's sensitivity measurement)."""
    if not b or "kld_alone" not in b or not any(v is not None for row in b["kld_alone"] for v in row):
        s.why["kld_layers"] = ("measured only by mixed precision (quantize --target-bpw / --max-size): each unit's "
                               "KLD alone at INT4")
        return None
    return [sum(v for v in row if v is not None) for row in b["kld_alone"]]


def kld_histograms(s: Subject) -> list[tuple[str, list[float], list[int]]]:
    """(which measurement, edges, counts) of the quantize probe and the newest eval's KLD that recorded one."""
    out = []
    q = s.fam.quantized
    probe = (q.metrics.get("probe") or {}) if q is not None else {}
    if probe.get("histogram"):
        out.append(("probe", probe["histogram"]["edges"], probe["histogram"]["counts"]))
    for ev in s.fam.evals:
        rep = read_report(ev) or {}
        h = (rep.get("kld") or {}).get("histogram")
        if h:
            out.append(("eval", h["edges"], h["counts"]))
            break
    if not out:
        s.why["kld_hist"] = ("no per-position histogram in the quantize probe or an eval's kld (artifacts made before "
                             "llmq recorded one, or none measured)")
    return out


def experts(s: Subject) -> dict | None:
    arch = (s.fam.root.config.get("architecture") or {})
    if not arch.get("num_experts"):
        s.why["experts"] = "not a mixture-of-experts model"
        return None
    q = s.fam.quantized
    cov = q.config.get("expert_coverage") if q is not None else None
    if not cov:
        s.why["experts"] = "no quantized artifact in the lineage recorded expert coverage"
        return None
    if "routed_tokens" not in cov:
        s.why["experts"] = str(cov.get("scheme") or "no routing recorded")
        return None
    return {"from": q.ref, "routed": cov["routed_tokens"], "tokens": cov.get("tokens_per_expert"),
            "never": cov.get("never_routed") or [], "scheme": cov.get("scheme", "")}


def evaluation(s: Subject) -> dict | None:
    """The newest eval-report with deltas (or a KLD): its deltas and the gates judged on it."""
    for ev in s.fam.evals:
        rep = read_report(ev)
        if rep and (rep.get("deltas") or rep.get("kld")):
            results = ([{"gate": str(r.gate), "passed": r.passed, "what": r.what, "value": r.value}
                        for r in check_gates(parse_gates(s.gate), rep)] if s.gate else rep.get("gates") or [])
            gates = []
            for g in results:
                (parsed,) = parse_gates(g["gate"])
                gates.append(dict(g, name=ALIASES.get(parsed.name, parsed.name), op=parsed.op,
                                  threshold=parsed.threshold, kld=parsed.name in KLD_NAMES))
            return {"from": ev.ref, "deltas": rep.get("deltas") or {}, "kld": rep.get("kld"), "gates": gates,
                    "evaluated": (rep.get("evaluated") or {}).get("name"),
                    "baseline": (rep.get("baseline") or {}).get("name")}
    s.why["eval"] = "no eval-report with a baseline made from this artifact or its lineage (llmq eval)"
    return None


def bench(s: Subject) -> dict | None:
    for b in s.fam.benches:
        rep = read_report(b)
        if rep and rep.get("mode") == "offline" and rep.get("offline"):
            return {"from": b.ref, "mode": "offline", "rows": rep["offline"]}
        if rep and rep.get("levels"):
            return {"from": b.ref, "mode": "online", "model": (rep.get("settings") or {}).get("model"),
                    "levels": [{k: lv.get(k) for k in ("label", "kind", "value", "summary")} for lv in rep["levels"]]}
    s.why["bench"] = "no bench-report made from this artifact or its lineage (llmq bench serve / offline)"
    return None
