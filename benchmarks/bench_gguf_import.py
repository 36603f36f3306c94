"""Time to import a GGUF (`llmq import`), with its metadata parsed once (llmq's import) against transformers parsing it
once per from_pretrained (config, tokenizer, weights), in one run, each into a fresh store; the two checkpoints must
be byte-identical.

    python benchmarks/bench_gguf_import.py [--model gemma3-270m | smollm2-135m-instruct | FILE.gguf] [--repeats 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmq.artifacts import Store  # noqa: E402
from llmq.bench.hw import machine_key  # noqa: E402
from llmq.models import resolve  # noqa: E402
from llmq.models.default import PACKAGED, packaged_gguf  # noqa: E402


def _timed(importer, gguf: Path, root: Path) -> tuple[float, dict[str, bytes]]:
    t = time.perf_counter()
    art = importer(gguf, Store(root), "model", {"bench": True})
    seconds = time.perf_counter() - t
    return seconds, {p.name: p.read_bytes() for p in sorted(art.path.iterdir()) if p.name != "llmq.json"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma3-270m", help="a packaged model's name or a .gguf file")
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args()
    gguf = packaged_gguf(PACKAGED[args.model]) if args.model in PACKAGED else Path(args.model)
    variants = {"transformers (a parse per from_pretrained)": resolve._import_gguf,
                "llmq (one parse)": resolve.import_gguf}
    times: dict[str, list[float]] = {k: [] for k in variants}
    files = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for i, (name, importer) in enumerate(variants.items()):
                seconds, files[name] = _timed(importer, gguf, Path(tmp) / f"{r}-{i}")
                times[name].append(seconds)
    if len({tuple(f.items()) for f in files.values()}) != 1:
        raise SystemExit("the two imports wrote different files")
    base = statistics.median(times[next(iter(variants))])
    print(f"{gguf.name} on {machine_key('cpu')}: median of {args.repeats}, files byte-identical")
    for name, ts in times.items():
        print(f"  {name:44s} {statistics.median(ts):7.1f} s   {base / statistics.median(ts):5.2f}x")


if __name__ == "__main__":
    main()
