"""What the docs quote from the code stays what the code says: the architecture registry docs/extending.md lists."""

from __future__ import annotations

import re
from pathlib import Path

from llmq.models.arch import ARCHS

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_extending_lists_exactly_the_registry():
    text = " ".join((DOCS / "extending.md").read_text().split())
    listed = re.search(r"The registry holds (\w+): (.*?); `tests/test_docs.py`", text)
    assert listed, "docs/extending.md no longer lists the registry"
    named = set(re.findall(r"`(\w+ForCausalLM)`", listed.group(2)))
    assert named == {a.architecture for a in ARCHS.values()}
    numbers = {"ten": 10, "eleven": 11, "twelve": 12, "thirteen": 13, "fourteen": 14}
    assert numbers.get(listed.group(1)) == len(ARCHS), listed.group(1)


def test_readme_quickstart_table_quotes_docs_results_json():
    """Every figure of the README's quickstart table, as the table formats it, from docs/results.json (which
    benchmarks/quickstart_results.py writes from a run's artifacts)."""
    import json

    s = json.loads((DOCS / "results.json").read_text())["quickstart"]["stages"]
    readme = (DOCS.parent / "README.md").read_text()
    rows = {line.split("|")[1].split("(")[0].strip(): line for line in readme.splitlines()
            if line.startswith("| quantize") or line.startswith("| build (") or line.startswith("| eval (")}
    q, kv, b, ev = s["quantize"], s["quantize_kv"], s["build"], s["eval"]

    def sci(x: float, fmt: str) -> str:   # 3.9e-6, as the README writes exponents
        return format(x, fmt).replace("e-0", "e-").replace("e+0", "e")

    def signed(x: float) -> str:
        return f"{x:+.1f}".replace("-", "−")

    expected = {
        "quantize": [f"{q['mib']:.0f} MiB", f"{q['ratio_vs_bf16']:.2f}x smaller", f"linear layers "
                     f"{q['linear_ratio_vs_bf16']:.2f}x", f"KLD {q['kld']:.3f}", f"top-1 {100 * q['top1']:.1f}%"],
        "quantize-kv": [f"KLD {kv['kld']:.4f}", f"top-1 {100 * kv['top1']:.1f}%"],
        "build": [f"{b['heads'][0]} / {b['heads'][1]} heads padded to {b['padded_heads'][0]} / {b['padded_heads'][1]}",
                  f"max relative error {sci(b['max_rel_error'], '.1e')}", f"tolerance {sci(b['tolerance'], '.0e')}"],
        "eval": [f"math {signed(ev['math']['delta'])} (95% CI {signed(ev['math']['ci95'][0])}.."
                 f"{signed(ev['math']['ci95'][1])})",
                 f"code {signed(ev['code']['delta'])} ({signed(ev['code']['ci95'][0])}.."
                 f"{signed(ev['code']['ci95'][1])})",
                 f"KLD {ev['kld']:.3f}"],
    }
    assert set(rows) == set(expected), rows
    for stage, figures in expected.items():
        for figure in figures:
            assert figure in rows[stage], f"README's {stage} row does not say {figure!r} (docs/results.json)"
