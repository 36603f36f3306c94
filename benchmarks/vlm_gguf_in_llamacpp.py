"""A vision-language model's GGUF export in llama.cpp itself: the language model's file and the tower's mmproj,
served by llama-server (`--mmproj`) and compared with transformers on an image prompt, and the mmproj compared
tensor by tensor with llama.cpp's own converter (`convert_hf_to_gguf.py --mmproj`).

The model is the test suite's tiny random Gemma 3 VLM (tests/vlm.py: a 2-layer SigLIP tower over 32 x 32 images, 4
tokens an image) and a generated digit image; nothing is downloaded. The converter reads the releases' layout
(`vision_tower.vision_model.*`), so it converts a copy saved that way. Not part of CI (llama.cpp is built outside
the project: docs/bench.md).

    python benchmarks/vlm_gguf_in_llamacpp.py --llama-cpp SRC [--work DIR]

Prints the mmproj comparison, llama.cpp's and transformers' probabilities of llama.cpp's top-5 next tokens (and how
far transformers moves with blank pixels: what an image ignored would cost), both greedy continuations; exits 1 when
the files differ or the probabilities are further apart than --tolerance.
"""

from __future__ import annotations

import argparse
import base64
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

PROMPT = ("the abc ", " abc the")   # the text before and after the image


def release_layout(src: Path, dst: Path) -> None:
    """A copy of the checkpoint with the tower under `vision_tower.vision_model.` (the releases' names)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    t = load_file(dst / "model.safetensors")
    save_file({k.replace("vision_tower.", "vision_tower.vision_model.", 1) if k.startswith("vision_tower.") else k: v
               for k, v in t.items()}, dst / "model.safetensors", metadata={"format": "pt"})


def compare_files(ours: Path, theirs: Path) -> list[str]:
    """Every difference of metadata (but the names) and of tensors (type, shape, bytes) between two GGUF files."""
    import gguf

    a, b = gguf.GGUFReader(ours), gguf.GGUFReader(theirs)
    skip = ("GGUF.", "general.name", "general.size_label")
    fa, fb = ({f.name: f.contents() for f in r.fields.values() if not f.name.startswith(skip)} for r in (a, b))
    out = [f"{k}: {fa.get(k)!r} != {fb.get(k)!r}" for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)]
    ta, tb = ({t.name: t for t in r.tensors} for r in (a, b))
    out += [f"tensor {n} only in {'llmq' if n in ta else 'the converter'}'s" for n in sorted(set(ta) ^ set(tb))]
    for n in sorted(set(ta) & set(tb)):
        x, y = ta[n], tb[n]
        if x.tensor_type != y.tensor_type or list(x.shape) != list(y.shape) or \
                not np.array_equal(np.asarray(x.data), np.asarray(y.data)):
            out.append(f"tensor {n}: {x.tensor_type.name} {list(x.shape)} != {y.tensor_type.name} {list(y.shape)} "
                       "or other bytes")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", required=True, help="llama.cpp source tree (its build/bin has llama-server)")
    ap.add_argument("--work", type=Path, default=None, help="working directory (default: a temporary one)")
    ap.add_argument("--port", type=int, default=8093)
    ap.add_argument("--tolerance", type=float, default=1e-3, help="most |p| difference over the top 5 tokens")
    a = ap.parse_args()
    import httpx
    import torch
    from PIL import Image
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration
    from vlm import image, make_tiny_vlm

    from llmq.artifacts import Store
    from llmq.bench.llamacpp import locate, run, stop
    from llmq.models import resolve_model
    from llmq.pipeline.targets.stage import BuildOptions, build_engine

    tools = locate(a.llama_cpp)
    work = a.work or Path(tempfile.mkdtemp(prefix="vlm-gguf-"))
    model = make_tiny_vlm(work / "vlm")
    store = Store(work / "store")
    engine = build_engine(resolve_model(str(model), store), store, BuildOptions(target="gguf", probe_tokens=0))
    text_gguf, mmproj = sorted(engine.path.glob("[!m]*.gguf"))[0], next(engine.path.glob("mmproj-*.gguf"))
    release_layout(model, work / "release")
    theirs = work / "converter-mmproj.gguf"
    run([sys.executable, str(tools.converter), str(work / "release"), "--mmproj", "--outfile", str(theirs)],
        "convert_hf_to_gguf.py --mmproj", env=tools.converter_env())
    diffs = compare_files(mmproj, theirs)
    print(f"mmproj against llama.cpp's converter: {'identical tensors and keys' if not diffs else diffs}")
    picture = work / "digit.png"
    image("digit", size=(32, 32), seed=1).save(picture)
    server = subprocess.Popen([tools.tool("llama-server"), "-m", str(text_gguf), "--mmproj", str(mmproj), "--port",
                               str(a.port), "-t", "2", "-c", "256"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        c = httpx.Client(base_url=f"http://127.0.0.1:{a.port}", timeout=60)
        for _ in range(120):
            try:
                if c.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        marker = c.get("/props").json()["media_marker"]
        got = c.post("/completion", json={
            "prompt": {"prompt_string": f"{PROMPT[0]}{marker}{PROMPT[1]}",   # llama-server adds the BOS itself
                       "multimodal_data": [base64.b64encode(picture.read_bytes()).decode()]},
            "n_predict": 6, "temperature": 0, "n_probs": 5, "return_tokens": True, "cache_prompt": False}).json()

        def tokens(s: str) -> list[int]:
            return [t if isinstance(t, int) else t["id"]
                    for t in c.post("/tokenize", json={"content": s, "parse_special": True}).json()["tokens"]]

        proc = AutoProcessor.from_pretrained(model)
        tok = proc.tokenizer
        boi, eoi, soft = (tok.convert_tokens_to_ids(t) for t in ("<start_of_image>", "<end_of_image>",
                                                                   "<image_soft_token>"))
        # what mtmd feeds the model: its BOS, the text, the image between its begin / end tokens, the text
        ids = tokens("<bos>" + PROMPT[0]) + [boi] + [soft] * 4 + [eoi] + tokens(PROMPT[1])
    finally:
        stop(server)
    pixels = proc.image_processor(Image.open(picture).convert("RGB"), return_tensors="pt")["pixel_values"]
    hf = Gemma3ForConditionalGeneration.from_pretrained(model, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        out = hf.generate(input_ids=x, pixel_values=pixels, token_type_ids=(x == soft).long(), max_new_tokens=6,
                          min_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True)
        blank = hf(input_ids=x, pixel_values=torch.zeros_like(pixels),
                   token_type_ids=(x == soft).long()).logits[0, -1].softmax(-1)
    p = out.scores[0][0].softmax(-1)
    top = got["completion_probabilities"][0]["top_logprobs"]
    diff = max(abs(math.exp(d["logprob"]) - float(p[d["id"]])) for d in top)
    moved = max(abs(float(blank[d["id"]]) - float(p[d["id"]])) for d in top)
    print("next token, llama.cpp's top 5: id, llama.cpp p, transformers p")
    for d in top:
        print(f"  {d['id']:>5} {math.exp(d['logprob']):.5f} {float(p[d['id']]):.5f}")
    print(f"most |p| difference {diff:.2e} (transformers with blank pixels moves {moved:.2e}); greedy llama.cpp "
          f"{got['tokens']} transformers {out.sequences[0, len(ids):].tolist()}")
    return 1 if diffs or diff > a.tolerance or got["tokens"] != out.sequences[0, len(ids):].tolist() else 0


if __name__ == "__main__":
    sys.exit(main())
