"""What an artifact is at a glance, from its manifest and its lineage's: the model it came from, how it was quantized,
how far its next-token distributions moved (KLD) and which quality gates it passed. `llmq report` heads its page with
this card and `llmq serve`'s chat page shows it.

An artifact's numbers often live on a relative: an engine's quantization and probe on the quantized artifact it was
built from, its task deltas and gates on an eval-report made from it or from that quantized artifact. `Family`
gathers them: the chain back to the source model (`Store.lineage`) and the eval and bench reports made from any
member of that chain, the nearest member's first.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .store import Artifact, ArtifactError, Store

REPORT_FILE = "report.json"  # what eval-report and bench-report artifacts hold (evals/report.py, bench/report.py)


@dataclass
class Family:
    """`art`, the chain from it to its source model (art first) and the reports made from members of that chain."""

    art: Artifact
    chain: list[Artifact]
    evals: list[Artifact]   # eval-reports, the nearest chain member's first, each member's newest first
    benches: list[Artifact]

    @classmethod
    def of(cls, store: Store, art: Artifact) -> "Family":
        chain = store.lineage(art)
        reports = {"eval-report": [], "bench-report": []}
        for kind, found in reports.items():
            for a in [art] + [kid for member in chain for kid in store.children(member, kind)]:
                if a.kind == kind and a.id not in {f.id for f in found}:
                    found.append(a)
        return cls(art, chain, reports["eval-report"], reports["bench-report"])

    @property
    def root(self) -> Artifact:
        return self.chain[-1]

    def nearest(self, test) -> Artifact | None:
        """The first member of the chain (art first) for which test(artifact) holds."""
        return next((a for a in self.chain if test(a)), None)

    @property
    def quantized(self) -> Artifact | None:
        """The weight-quantized artifact in the chain (a quantize-kv artifact's own config has no method)."""
        return self.nearest(lambda a: a.kind == "quantized" and "method" in a.config)


def read_report(art: Artifact) -> dict | None:
    """An eval- or bench-report's report.json, None if it cannot be read (the caller shows that as missing)."""
    try:
        return json.loads(art.file(REPORT_FILE).read_text())
    except (OSError, ValueError):
        return None


def quantization(fam: Family) -> dict | None:
    """How the weights (and the KV cache) were quantized: the nearest quantized artifact's settings."""
    q = fam.quantized
    kv = fam.nearest(lambda a: a.config.get("kv_cache_dtype"))
    if q is None and kv is None:
        return None
    c = q.config if q is not None else {}
    mixed = c.get("mixed_precision") or {}
    return {"ref": q.ref if q is not None else None, "method": c.get("method"), "scheme": c.get("scheme"),
            "bits": c.get("bits"), "group_size": c.get("group_size"), "format": c.get("format"),
            "bpw": mixed.get("bpw"), "kv_cache": kv.config.get("kv_cache_dtype") if kv is not None else None}


def kld(fam: Family) -> dict | None:
    """The KL divergence from the baseline: the newest eval's over its tasks' text, else the quantize probe's."""
    for ev in fam.evals:
        k = ev.metrics.get("kld")
        if k is not None:
            return {"mean": k, "top1": ev.metrics.get("top1"), "from": f"eval {ev.ref}"}
    q = fam.quantized
    probe = q.metrics.get("probe") if q is not None else None
    if probe:
        return {"mean": probe["kld_mean"], "top1": 100 * probe["top1"], "from": f"quantize probe of {q.ref}"}
    return None


def gates(fam: Family) -> dict | None:
    """The gates of the newest eval-report that judged any: [{gate, passed, what}] and where they come from."""
    for ev in fam.evals:
        rep = read_report(ev)
        if rep and rep.get("gates"):
            return {"from": ev.ref, "gates": [{k: g.get(k) for k in ("gate", "passed", "what")} for g in rep["gates"]]}
    return None


def card(store: Store, art: Artifact, fam: Family | None = None) -> dict:
    """The card of `art` (from `fam`, its family, when given): what it is, the model it came from, quantization,
    KLD, gates (None where unmeasured)."""
    if fam is None:
        try:
            fam = Family.of(store, art)
        except ArtifactError:   # a damaged relative: the card of the artifact alone
            fam = Family(art, [art], [], [])
    root = fam.root
    return {"ref": art.ref, "kind": art.kind, "id": art.id, "size_bytes": art.payload_bytes,
            "model": {"ref": root.ref, "id": root.id,
                      "architecture": (root.config.get("architecture") or {}).get("architecture")},
            "quantization": quantization(fam), "kld": kld(fam), "gates": gates(fam)}
