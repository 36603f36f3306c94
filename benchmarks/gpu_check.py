"""The CUDA paths of llmq, checked and timed in one run on a GPU (issue 14); results as JSON.

Models are made here from configs with random weights (no hub, no carried checkpoints): a SmolLM2-135M-shaped one
for correctness and a Llama-3-8B-shaped one for speed, each saved as a bf16 Hugging Face directory with the
tokenizer given by --tokenizer, then run through the real commands (`llmq import`, `llmq quantize --device cuda`,
`llmq quantize-kv`, `llmq serve`).

--part correctness (SmolLM2 shape): for each scheme, the llmq runtime on CUDA (bf16) against
  (a) transformers in float32 on the same weights (a quantized artifact's weights dequantized; for W8A8 / FP8 this
      leaves out activation rounding, so it is reported, not gated), and
  (b) the llmq runtime on CPU in float32 over the same artifact (the same arithmetic, activation rounding included);
  mean KLD and top-1 over --tokens positions, and greedy continuations of 4 prompts checked against the float32
  reference token by token (a token other than the reference's argmax counts only where the reference prefers its
  own token by more than --tie nats). Also: 32 concurrent requests vs one at a time, prefix-cache hits, chunked
  prefill, KV cache INT8 / FP8, and `llmq serve --device cuda` answering HTTP requests.
--part speed (Llama-3-8B shape): batch-1 decode tokens/s and MBU for bf16, INT8, INT4 (MBU = weight + KV bytes
  read per step / step time / the device-to-device copy bandwidth measured in this run); output throughput at
  concurrency 1/8/32/64 (128-token prompts, 128 new tokens) against transformers `generate` run one prompt at a
  time (eager, and with its static cache, which compiles the decoding step), as ratios.
--part gptq (Llama-3-8B shape): `llmq quantize --method gptq --bits 4 --device cuda`: wall time, peak GPU memory.
--part layers: each quantized linear class on the GPU against itself on the CPU in float32 (fresh random weights).
--part families: every declared family's tiny random model on the GPU (float32 and bf16) against transformers float32
  on the CPU, and a Qwen3.5-shaped hybrid at real layer width against transformers on the GPU, with its decode speed.
--part layer_speed: the Llama-3-8B layer's four linears (qkv, o, gate_up, down) in every weight format at 1 / 16 /
  128 rows: median CUDA-event time, weight bytes read per second, ratio to bf16 (no model files: seconds, not minutes).

    python benchmarks/gpu_check.py --tokenizer DIR --out DIR [--part correctness speed gptq] [--only NAME ...]
        [--small]

--only limits layers and correctness to the named schemes (bf16 always runs in correctness: it is the yardstick) and
the named engine checks (kv-int8 kv-fp8 batching prefix_cache chunked_prefill serve_http; all of them without --only).

--small shrinks the models (2 layers, hidden 128) to try the script on a CPU-only machine with --device cpu.
Each part appends to DIR/gpu_check.json as it goes, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_serve_throughput import batch1_decode, hf_sequential, make_prompts, runtime_concurrency  # noqa: E402

from llmq.artifacts import Store  # noqa: E402
from llmq.bench.llamacpp import stop  # noqa: E402
from llmq.runtime import EngineConfig, LLMEngine, SamplingParams  # noqa: E402

SMOL = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
            max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5)
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
                 max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5)
SMALL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32)

# name -> `llmq quantize` arguments (weights quantized on the GPU by the quantize stage itself)
SCHEMES = {
    "int8": ["--method", "rtn", "--bits", "8"],
    "int4-rtn": ["--method", "rtn", "--bits", "4", "--group-size", "64"],
    "int4-rtn-asym": ["--method", "rtn", "--bits", "4", "--group-size", "64", "--asym"],
    "int4-gptq": ["--method", "gptq", "--bits", "4", "--group-size", "64"],
    "w8a8": ["--method", "smoothquant", "--bits", "8"],
    "fp8": ["--method", "fp8", "--bits", "8"],
    "fp8-static": ["--method", "fp8", "--bits", "8", "--activations", "static"],
    "fp8-block": ["--method", "fp8", "--bits", "8", "--group-size", "128"],
    "nvfp4": ["--method", "nvfp4"],
    "mxfp4": ["--method", "mxfp4"],
    "nvfp4-w4a4": ["--method", "nvfp4", "--w4a4"],
    "mxfp4-w4a4": ["--method", "mxfp4", "--w4a4"],
    "nvfp4-gptq": ["--method", "nvfp4", "--gptq", "--act-order"],
}
# transformers on dequantized weights leaves their activation rounding out
ACT_QUANT = ("w8a8", "fp8", "fp8-static", "fp8-block", "nvfp4-w4a4", "mxfp4-w4a4")


class Results:
    """The JSON file every check appends to, written after each record."""

    def __init__(self, path: Path):
        self.path = path
        self.data = json.loads(path.read_text()) if path.is_file() else {}

    def put(self, part: str, key: str, value) -> None:
        self.data.setdefault(part, {})[key] = value
        self.path.write_text(json.dumps(self.data, indent=1, default=str))
        print(f"[{part}] {key}: {json.dumps(value, default=str)[:300]}", flush=True)


def guarded(results: Results, part: str, key: str, fn):
    """Run one check; a failure is recorded (with its traceback's end) and the run goes on."""
    t = time.perf_counter()
    try:
        value = fn()
    except Exception as e:  # noqa: BLE001 - every failure is a finding to record
        value = {"error": f"{type(e).__name__}: {e}"[:500], "traceback": traceback.format_exc(limit=6)[-1500:]}
    if isinstance(value, dict):
        value.setdefault("seconds", round(time.perf_counter() - t, 1))
    results.put(part, key, value)
    return value


# -- models ---------------------------------------------------------------------------------------------------------
def make_model(out: Path, shape: dict, tokenizer: Path, device: str, embed_std: float) -> Path:
    """A random-weight Llama of `shape`, saved as bf16 safetensors with the tokenizer. The embedding is drawn wider
    than the default init (and tied to lm_head for SmolLM2) so next-token distributions are peaked like a trained
    model's instead of near uniform, which would make KLD and top-1 blind."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if (out / "config.json").is_file():
        return out
    cfg = LlamaConfig(**shape, dtype="bfloat16", bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, embed_std)
    model.save_pretrained(str(out), max_shard_size="5GB")
    for f in tokenizer.iterdir():
        shutil.copy(f, out / f.name)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def llmq(store: Path, *args: str) -> dict:
    """Run an llmq command that prints its manifest (--json); raise with its last error line when it fails."""
    cmd = [sys.executable, "-m", "llmq", "--store", str(store), *args, "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:3])}: exit {p.returncode}: {p.stderr.strip()[-800:]}")
    return json.loads(p.stdout)


def artifact_path(store: Path, manifest: dict) -> Path:
    return Store(store).resolve(f"{manifest['name']}/v{manifest['version']}").path


def imported(args, work: Path, shape: dict, name: str, embed_std: float) -> tuple[Path, Path, Path]:
    """(HF directory, store, imported model artifact) of a random model of `shape` (SMALL-shrunk with --small)."""
    src = make_model(work / name, {**shape, **(SMALL if args.small else {})}, args.tokenizer, args.device, embed_std)
    store = work / "store"
    return src, store, artifact_path(store, llmq(store, "import", str(src)))


# -- metrics --------------------------------------------------------------------------------------------------------
def compare(ref: torch.Tensor, test: torch.Tensor) -> dict:
    """Mean KLD(ref || test) and top-1 agreement of two [T, V] log-prob tensors."""
    ref, test = ref.double(), test.double()
    kld = (ref.exp() * (ref - test)).sum(-1)
    return {"kld": float(kld.mean()), "kld_max": float(kld.max()),
            "top1": float((ref.argmax(-1) == test.argmax(-1)).double().mean()), "tokens": ref.shape[0]}


def greedy_check(tokens: list[int], prompt_len: int, ref: torch.Tensor, tie: float) -> dict:
    """Greedy tokens against a reference's log-probs over prompt + tokens: exact agreement, and agreement where the
    reference's margin for its own argmax over the chosen token exceeds `tie`."""
    rows = ref[prompt_len - 1:prompt_len - 1 + len(tokens)]
    best = rows.argmax(-1)
    chosen = torch.tensor(tokens)
    margin = rows.gather(1, best[:, None])[:, 0] - rows.gather(1, chosen[:, None])[:, 0]
    mism = (best != chosen).nonzero().flatten().tolist()
    return {"tokens": len(tokens), "exact": len(tokens) - len(mism), "first_mismatch": mism[0] if mism else None,
            "beyond_tie": int((margin > tie).sum()), "max_margin": float(margin.max())}


class HFReference:
    """transformers in float32 on the GPU over the bf16 source, its linears replaceable by an artifact's dequantized
    weights."""

    def __init__(self, source: Path, device: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32).to(device).eval()
        self.device = device
        self.source = {k: v.clone() for k, v in self.model.state_dict().items()}

    def load(self, artifact: Path | None) -> None:
        from llmq.models.reader import CheckpointReader

        self.model.load_state_dict(self.source)
        if artifact is None:
            return
        ckpt = CheckpointReader(artifact)  # every tensor: SmoothQuant, for one, folds its scales into the norms
        linears = {f"{n}.weight" for i in range(ckpt.spec.num_layers) for n in ckpt.arch.linear_names(i)}
        sd = {k: ckpt.linear(k[:-len(".weight")]).dense(torch.float32) if k in linears else
              ckpt.tensor(k).float() for k in self.source if k != "lm_head.weight" or ckpt.has_lm_head()}
        self.model.load_state_dict(sd, strict=False)

    @torch.no_grad()
    def prompt_logprobs(self, ids: list[int]) -> torch.Tensor:
        """[T, vocab] next-token log-probs, like LLMEngine.prompt_logprobs."""
        x = torch.tensor([ids], device=self.device)
        return self.model(x).logits[0].float().log_softmax(-1).cpu()


def engine(path: Path, device: str, **kw) -> LLMEngine:
    cfg = dict(device=device, kv_cache_memory=256 << 20, max_model_len=1024, max_num_seqs=64,
               max_num_batched_tokens=1024)
    cfg.update(kw)
    return LLMEngine(path, EngineConfig(**cfg))


def runtime_logprobs(eng: LLMEngine | HFReference, seqs: list[list[int]]) -> torch.Tensor:
    return torch.cat([eng.prompt_logprobs(s) for s in seqs])


# -- part 1: correctness --------------------------------------------------------------------------------------------
def part_correctness(args, res: Results, work: Path) -> None:
    dev = args.device
    _, store, model_art = imported(args, work, SMOL, "smol-random", embed_std=0.1)
    vocab = SMOL["vocab_size"]
    n_seq = max(1, args.tokens // 128)
    seqs = make_prompts(n_seq, 128, vocab, seed=1)
    prompts = make_prompts(4, 32, vocab, seed=2)
    hf = HFReference(model_art, dev)

    def dense_floor():  # how far transformers' own bf16 is from its float32: the yardstick for bf16 noise
        from transformers import AutoModelForCausalLM

        m16 = AutoModelForCausalLM.from_pretrained(str(model_art), dtype=torch.bfloat16).to(dev).eval()
        hf.load(None)
        with torch.no_grad():
            lp16 = torch.cat([m16(torch.tensor([s], device=dev)).logits[0].float().log_softmax(-1).cpu()
                              for s in seqs])
        return compare(runtime_logprobs(hf, seqs), lp16)

    floor = guarded(res, "correctness", "hf_bf16_vs_hf_fp32", dense_floor).get("kld", 0.0)

    artifacts: dict[str, Path | None] = {"bf16": None}
    for name, qargs in SCHEMES.items():
        if args.only and name not in args.only:
            continue
        v = guarded(res, "quantize", name, lambda qargs=qargs, name=name: _quantize(store, model_art, qargs, name, dev))
        if "error" not in v:
            artifacts[name] = Path(v["path"])
    wanted = lambda check: not args.only or check in args.only  # noqa: E731
    for kv in ("int8", "fp8"):
        if not wanted(f"kv-{kv}"):
            continue
        v = guarded(res, "quantize", f"kv-{kv}", lambda kv=kv: _quantize_kv(store, model_art, kv, dev))
        if "error" not in v:
            artifacts[f"kv-{kv}"] = Path(v["path"])

    for name, path in artifacts.items():
        guarded(res, "correctness", name, lambda name=name, path=path: _check_artifact(
            name, path or model_art, hf, seqs, prompts, dev, args.tie, dequant=path is not None and
            not name.startswith("kv-"), floor=floor))
    if wanted("batching"):
        guarded(res, "correctness", "batching_32", lambda: _check_batching(model_art, dev, vocab, "bfloat16"))
        guarded(res, "correctness", "batching_32_fp32", lambda: _check_batching(model_art, dev, vocab, "float32"))
    if wanted("prefix_cache"):
        guarded(res, "correctness", "prefix_cache", lambda: _check_prefix_cache(model_art, dev, vocab))
    if wanted("chunked_prefill"):
        guarded(res, "correctness", "chunked_prefill", lambda: _check_chunked(model_art, dev, vocab))
    if wanted("serve_http"):
        guarded(res, "correctness", "serve_http", lambda: _check_serve(model_art, dev))


def _quantize(store: Path, model: Path, qargs: list[str], name: str, dev: str) -> dict:
    man = llmq(store, "quantize", str(model), *qargs, "--device", dev, "--num-samples", "16", "--seq-len", "256",
               "--probe-tokens", "512", "--name", f"smol-{name}")
    m = man["metrics"]
    return {"path": str(artifact_path(store, man)), "scheme": man["config"]["scheme"], "wall_s": m["wall_time_s"],
            "device": m.get("device"), "probe": m.get("probe"), "peak_device_bytes": m.get("peak_device_bytes")}


def _quantize_kv(store: Path, model: Path, kv: str, dev: str) -> dict:
    man = llmq(store, "quantize-kv", str(model), "--kv", kv, "--device", dev, "--num-samples", "8",
               "--probe-tokens", "512", "--name", f"smol-kv{kv}")
    return {"path": str(artifact_path(store, man)), "metrics": {k: v for k, v in man["metrics"].items()
                                                                if not isinstance(v, (list, dict))}}


def _check_artifact(name: str, path: Path, hf: HFReference, seqs, prompts, dev: str, tie: float,
                    dequant: bool, floor: float) -> dict:
    """The kernels: llmq on the GPU computing in float32 against llmq float32 on the CPU (the same arithmetic: only
    the matmul kernels differ). The serving setup: llmq on the GPU in bf16 against transformers float32 on the same
    weights, gated at twice transformers' own bf16-vs-float32 KLD (`floor`) where the weights are all that differ
    (not with activation or KV rounding, which bf16 activations shift: reported only)."""
    out = {}
    sp = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    runs = {}
    for dtype in ("bfloat16", "float32"):
        gpu = engine(path, dev, dtype=dtype)
        out.setdefault("kernels", _kernels(gpu))
        runs[dtype] = (runtime_logprobs(gpu, seqs), [o.output_token_ids for o in gpu.generate(prompts, sp)])
        gpu.shutdown()
    cpu = engine(path, "cpu", max_num_seqs=4)
    lp_cpu = runtime_logprobs(cpu, seqs)
    out["gpu_fp32_vs_cpu_fp32"] = compare(lp_cpu, runs["float32"][0])
    out["greedy_gpu_fp32_vs_cpu"] = _merge([greedy_check(g, len(p), cpu.prompt_logprobs(p + g), tie)
                                            for p, g in zip(prompts, runs["float32"][1])])
    hf.load(path if dequant else None)
    out["gpu_bf16_vs_hf_fp32"] = compare(runtime_logprobs(hf, seqs), runs["bfloat16"][0])
    out["greedy_gpu_bf16_vs_hf_fp32"] = _merge([greedy_check(g, len(p), hf.prompt_logprobs(p + g), tie)
                                                for p, g in zip(prompts, runs["bfloat16"][1])])
    allowed = 1e-3
    if name in ACT_QUANT:
        out["amplification_floor"] = _amplification_floor(cpu, seqs, lp_cpu)
        allowed = max(allowed, 2 * max(out["amplification_floor"].values()))
    cpu.shutdown()
    kernel_ok = out["gpu_fp32_vs_cpu_fp32"]["kld"] <= allowed and out["greedy_gpu_fp32_vs_cpu"]["beyond_tie"] == 0
    gated = name not in ACT_QUANT and not name.startswith("kv-")
    serving_ok = not gated or (out["gpu_bf16_vs_hf_fp32"]["kld"] <= 2 * floor
                               and out["greedy_gpu_bf16_vs_hf_fp32"]["beyond_tie"] == 0)
    out["pass"] = kernel_ok and serving_ok
    return out


def _amplification_floor(cpu: LLMEngine, seqs, ref: torch.Tensor) -> dict:
    """How far float noise alone moves a model whose activations are rounded to 8 or 4 bits, on the CPU: the
    embedding nudged by 1e-6 relative in float32 (a few ulps, what other kernels' reduction orders do upstream; the
    table is stored bf16, so a nudged float32 copy replaces it), and every quantized linear's output rounded to bf16
    (what torch._scaled_mm's bf16 output does, even when the rest computes in float32). A flipped rounding decision
    is a whole int8 / FP8 / FP4 step, and a random 30-layer model amplifies it: on the first H200 run this reproduced
    the GPU-vs-CPU KLD of W8A8 (9.6e-4 vs 9.2e-4) and FP8 (0.0149 vs 0.0142)."""
    from llmq.runtime.layers import linear as L

    model, out = cpu.runner.model, {}
    saved = model.embed
    noise = torch.randn(saved.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    model.embed = (saved.double() * (1 + 1e-6 * noise)).float()
    out["embedding_nudged_1e-6"] = compare(ref, runtime_logprobs(cpu, seqs))["kld"]
    model.embed = saved
    finish = L.LinearBase._finish
    L.LinearBase._finish = lambda self, y, dtype: finish(self, y if isinstance(self, L.DenseLinear)
                                                         else y.to(torch.bfloat16), dtype)
    try:
        out["outputs_rounded_to_bf16"] = compare(ref, runtime_logprobs(cpu, seqs))["kld"]
    finally:
        L.LinearBase._finish = finish
    return out


def _merge(checks: list[dict]) -> dict:
    return {"tokens": sum(c["tokens"] for c in checks), "exact": sum(c["exact"] for c in checks),
            "beyond_tie": sum(c["beyond_tie"] for c in checks), "max_margin": max(c["max_margin"] for c in checks),
            "first_mismatch": [c["first_mismatch"] for c in checks]}


def _fast(m) -> bool:
    """Whether a linear layer runs its device kernel (not the exact fallback)."""
    from llmq.runtime.layers import act_quant as AQ
    from llmq.runtime.layers import linear as L
    from llmq.runtime.layers.fp4 import FP4Linear
    from llmq.runtime.layers.fp8_block import BlockFP8Linear

    if isinstance(m, FP4Linear):
        return m.dense is None
    flag = {L.Int8WeightOnlyLinear: "kernel", L.Int4WeightOnlyLinear: "packed", AQ.W8A8Linear: "cuda_int_mm",
            AQ.FP8Linear: "scaled_mm", BlockFP8Linear: "scaled_mm"}.get(type(m))
    return bool(getattr(m, flag, False)) if flag else False


def _kernels(eng: LLMEngine) -> dict:
    """Which execution path each linear class took on this device (the fast kernel or the exact fallback), and why
    not where the layer says (fallback_reason)."""
    from llmq.runtime.layers import linear as L

    seen: dict[str, dict] = {}
    for m in eng.runner.model.modules():
        if isinstance(m, L.LinearBase):
            d = seen.setdefault(type(m).__name__, {"n": 0, "fast": 0})
            d["n"] += 1
            d["fast"] += int(_fast(m))
            if getattr(m, "fallback_reason", None):
                d["why_not"] = m.fallback_reason
    return seen


def _check_batching(model: Path, dev: str, vocab: int, dtype: str) -> dict:
    """32 requests of different lengths run together vs each alone: greedy tokens equal."""
    import random

    rng = random.Random(3)
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randrange(8, 120))] for _ in range(32)]
    sp = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=2)
    eng = engine(model, dev, dtype=dtype)
    alone = [eng.generate([p], sp)[0] for p in prompts]
    together = eng.generate(prompts, sp)
    stats = eng.stats()
    eng.shutdown()
    same = sum(a.output_token_ids == b.output_token_ids for a, b in zip(alone, together))
    gaps = []  # at each first divergence: how close the alone-run's top two were
    for a, b in zip(alone, together):
        for i, (x, y) in enumerate(zip(a.output_token_ids, b.output_token_ids)):
            if x != y:
                top = sorted(a.new_logprobs[i].values(), reverse=True)
                gaps.append(top[0] - top[1] if len(top) > 1 else None)
                break
    return {"dtype": dtype, "requests": 32, "identical": same, "divergence_top2_gaps": gaps,
            "preemptions": stats.num_preemptions, "pass": same == 32 or all(g is not None and g < 0.05 for g in gaps)}


def _check_prefix_cache(model: Path, dev: str, vocab: int) -> dict:
    """A second request sharing a 256-token prefix reuses its cached blocks and continues exactly as without the
    cache (float32 compute, so equality is not at the mercy of bf16 ties)."""
    prefix = make_prompts(1, 256, vocab, seed=4)[0]
    a, b = prefix + make_prompts(1, 20, vocab, seed=5)[0], prefix + make_prompts(1, 20, vocab, seed=6)[0]
    sp = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    eng = engine(model, dev, dtype="float32")
    eng.generate([a], sp)
    hit = eng.generate([b], sp)[0]
    stats = eng.stats()
    eng.shutdown()
    cold = engine(model, dev, dtype="float32", enable_prefix_caching=False)
    ref = cold.generate([b], sp)[0]
    cold.shutdown()
    return {"cached_tokens": hit.num_cached_tokens, "hits": stats.prefix_cache_hits,
            "identical": hit.output_token_ids == ref.output_token_ids,
            "pass": hit.num_cached_tokens >= 240 and hit.output_token_ids == ref.output_token_ids}


def _check_chunked(model: Path, dev: str, vocab: int) -> dict:
    """A 600-token prompt prefilled in 64-token chunks (interleaved with 3 decoding requests) vs in one step."""
    long = make_prompts(1, 600, vocab, seed=7)[0]
    others = make_prompts(3, 16, vocab, seed=8)
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    out = {}
    runs = {}
    for budget in (64, 1024):
        eng = engine(model, dev, dtype="float32", max_num_batched_tokens=budget, enable_prefix_caching=False)
        res = eng.generate(others + [long], sp)
        runs[budget] = ([r.output_token_ids for r in res], runtime_logprobs(eng, [long]))
        eng.shutdown()
    out["identical_greedy"] = runs[64][0] == runs[1024][0]
    out["prompt_logprobs"] = compare(runs[1024][1], runs[64][1])
    out["pass"] = out["identical_greedy"] and out["prompt_logprobs"]["kld"] < 1e-5
    return out


def _check_serve(model: Path, dev: str) -> dict:
    """`llmq serve --device DEV` (the engine thread on the GPU): health, 16 concurrent completions, metrics."""
    import concurrent.futures as cf
    import socket

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "llmq", "serve", str(model), "--host", "127.0.0.1", "--port",
                             str(port), "--device", dev, "--kv-cache-memory", "256MiB"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            if proc.poll() is not None:
                raise RuntimeError(f"serve exited {proc.returncode}: {proc.stderr.read().decode()[-800:]}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        else:
            raise RuntimeError("serve not healthy in 120 s")

        def one(i):
            r = httpx.post(url + "/v1/completions", json={"prompt": f"Request {i}: count to ten", "max_tokens": 24,
                                                           "temperature": 0.7, "seed": i}, timeout=120)
            return r.status_code, r.json()["usage"]["completion_tokens"] if r.status_code == 200 else 0

        with cf.ThreadPoolExecutor(16) as ex:
            codes = list(ex.map(one, range(16)))
        chat = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                              "max_tokens": 8}, timeout=60)
        metrics = httpx.get(url + "/metrics", timeout=10).text
        return {"statuses": sorted({c for c, _ in codes}), "tokens": sum(n for _, n in codes),
                "chat_status": chat.status_code, "metrics_lines": len(metrics.splitlines()),
                "pass": all(c == 200 for c, _ in codes) and chat.status_code == 200}
    finally:
        stop(proc)


# -- part: families -----------------------------------------------------------------------------------------------
QWEN35_WIDTH = dict(vocab_size=49152, hidden_size=1024, intermediate_size=3584, num_hidden_layers=8,
                    num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                    linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                    linear_conv_kernel_dim=4, full_attention_interval=4, max_position_embeddings=8192,
                    tie_word_embeddings=False)
QWEN35_SMALL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, head_dim=32, linear_num_key_heads=2,
                    linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32)


def family_on_device(path: Path, dev: str, dtype: str, ids: list[int], prompts: list[list[int]], steps: int,
                     chunk: int) -> tuple[torch.Tensor, list[list[int]]]:
    """llmq's runtime on `dev` in `dtype`: prompt log-probs of ids (prefilled in chunks of `chunk` tokens) and greedy
    continuations of the prompts, all in flight together."""
    eng = LLMEngine(path, EngineConfig(device=dev, dtype=dtype, max_model_len=len(ids) + 64,
                                       kv_cache_memory=256 << 20, max_num_batched_tokens=chunk))
    try:
        got = eng.prompt_logprobs(ids).double().cpu()
        out = [o.output_token_ids for o in eng.generate(prompts, SamplingParams(max_tokens=steps, temperature=0,
                                                                                ignore_eos=True))]
    finally:
        eng.shutdown()
    return got, out


def part_families(args, res: Results, work: Path) -> None:
    """Every declared family's tiny random model (tests/helpers.py FAMILIES) on the device in float32 and bf16
    against transformers float32 on the CPU: KLD / top-1 over a chunked prefill, greedy continuations of prompts
    decoded together (float32: equal). Then a Qwen3.5-shaped hybrid at a real layer width (Gated DeltaNet heads of
    128, 8 layers) in bf16 against transformers float32 on the same device, and its decode speed."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from helpers import FAMILIES, family_model, hf_greedy, hf_logits

    dev = args.device
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (96,), generator=gen).tolist()
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 23, 40)]
    for family in args.only or FAMILIES:
        def run(family=family):
            path = family_model(work / "families" / family, family)
            ref = hf_logits(path, ids).double().log_softmax(-1)
            want = hf_greedy(path, prompts, 16)
            row = {}
            for dtype in ("float32", "bfloat16"):
                got, out = family_on_device(path, dev, dtype, ids, prompts, 16, chunk=32)
                # a token other than the reference's own counts where the reference preferred its own by > --tie
                checks = [greedy_check(o, len(p), hf_logits(path, p + o).double().log_softmax(-1), args.tie)
                          for p, o in zip(prompts, out)]
                row[dtype] = {**compare(ref, got), "greedy_equal": sum(o == w for o, w in zip(out, want)),
                              "prompts": len(prompts), "beyond_tie": sum(c["beyond_tie"] for c in checks)}
            return row
        guarded(res, "families", family, run)

    def width():
        from transformers import AutoConfig, AutoModelForCausalLM

        path = work / "qwen35-width"
        if not (path / "config.json").is_file():
            torch.manual_seed(0)
            shape = {**QWEN35_WIDTH, **(QWEN35_SMALL if args.small else {})}
            cfg = AutoConfig.for_model("qwen3_5_text", **shape, bos_token_id=1, eos_token_id=2,
                                       pad_token_id=2)
            model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
            with torch.no_grad():
                model.lm_head.weight.normal_(0, 0.1)   # peaked distributions (KLD is not blind), not one-hot
            model.save_pretrained(str(path))
            for f in args.tokenizer.iterdir():
                shutil.copy(f, path / f.name)
            del model
        vocab = QWEN35_WIDTH["vocab_size"]
        long = torch.randint(0, vocab, (256 if args.small else 1024,), generator=gen).tolist()
        ref, hf_bf16 = ({}, {})
        for dtype, logp in ((torch.float32, ref), (torch.bfloat16, hf_bf16)):
            hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(dev).eval()
            with torch.no_grad():
                logp["x"] = hf(torch.tensor([long], device=dev)).logits[0].double().log_softmax(-1).cpu()
            del hf
        ref = ref["x"]
        half = len(long) // 2
        fp32, _ = family_on_device(path, dev, "float32", long, [long[:8]], 1, chunk=256)
        got, out = family_on_device(path, dev, "bfloat16", long, [long[:half]], 64, chunk=256)
        with torch.no_grad():   # the greedy tokens teacher-forced through the float32 reference
            hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(dev).eval()
            forced = hf(torch.tensor([long[:half] + out[0]], device=dev)).logits[0].double().log_softmax(-1).cpu()
        del hf
        row = {"fp32_vs_hf_fp32": compare(ref, fp32), "bf16_vs_hf_fp32": compare(ref, got),
               "hf_bf16_vs_hf_fp32": compare(ref, hf_bf16["x"]), "greedy": greedy_check(out[0], half, forced, args.tie)}
        peak = copy_bandwidth(dev)
        row["decode_b1"] = batch1_decode(path, long[:128], 64, peak, EngineConfig(device=dev, max_num_seqs=1))
        eng = LLMEngine(path, EngineConfig(device=dev, max_num_seqs=32, max_model_len=1024))
        try:
            row["concurrency_32"] = runtime_concurrency(eng, make_prompts(64, 128, vocab), 32, 128)
        finally:
            eng.shutdown()
        row["hf_sequential_bf16"] = hf_sequential(path, make_prompts(4, 128, vocab), 128, device=dev,
                                                  dtype=torch.bfloat16)
        return row

    guarded(res, "families", "qwen3_5_text_width", width)


# -- part: layers -------------------------------------------------------------------------------------------------
def part_layers(args, res: Results, work: Path) -> None:
    """Each quantized linear class on the GPU against the same class on the CPU in float32 (itself checked against
    float64 references by tests/test_runtime_layers.py), fresh random weights and inputs, decode- and prefill-sized
    batches: max relative error. End to end, a random 30-layer model amplifies any rounding difference (activation
    rounding in W8A8 / FP8 most of all), so this is where a kernel's own error is seen."""
    from llmq import quant
    from llmq.runtime.layers import act_quant as AQ
    from llmq.runtime.layers import linear as L

    g = torch.Generator().manual_seed(12)
    for n, k in ((1536, 576), (4096, 4096), (1000, 4096)):   # 576: no 128-blocks (block FP8's fallback); 1000 rows:
                                                              # partial Triton tiles
        w = torch.randn(n, k, generator=g) * 0.05
        gs = 64
        s4 = w.view(n, k // gs, gs).abs().amax(-1) / 7
        q4 = quant.round_int(w.view(n, k // gs, gs), s4[..., None], bits=4).view(n, k).to(torch.int8)
        s8 = w.abs().amax(-1, keepdim=True) / 127
        q8 = quant.round_int(w, s8).to(torch.int8)
        s_fp8 = w.abs().amax(-1) / quant.FP8_MAX
        w_fp8 = quant.to_fp8(w, s_fp8[:, None])
        makers = {
            "int8": lambda d, dt: L.Int8WeightOnlyLinear(q8.to(d), s8.view(-1).to(d), None, None, dt),
            "int4": lambda d, dt: L.Int4WeightOnlyLinear(q4.to(d), s4.to(d), None, None, dt),
            "w8a8": lambda d, dt: AQ.W8A8Linear(q8.to(d), s8.view(-1).to(d), None, None, dt),
            "fp8": lambda d, dt: AQ.FP8Linear(w_fp8.to(d), s_fp8.to(d), None, True, None, dt),
            "fp8-weight-only": lambda d, dt: AQ.FP8Linear(w_fp8.to(d), s_fp8.to(d), None, False, None, dt),
            **_new_format_makers(w),
        }
        for name, make in makers.items():
            if args.only and name not in args.only:
                continue

            def check(make=make):
                cpu = make("cpu", torch.float32)
                out = {}
                for dt in (torch.bfloat16, torch.float32):
                    gpu = make(args.device, dt)
                    out[f"{str(dt)[6:]}_fast"] = _fast(gpu)
                    if getattr(gpu, "fallback_reason", None):
                        out[f"{str(dt)[6:]}_why_not"] = gpu.fallback_reason
                    for rows in (1, 5, 17, 64, 300):
                        x = torch.randn(rows, k, generator=g)
                        ref = cpu(x).double()
                        got = gpu(x.to(args.device, dt)).double().cpu()
                        out[f"{str(dt)[6:]}_rows{rows}"] = float((got - ref).abs().max() / ref.abs().max())
                out["max"] = max(v for v in out.values() if isinstance(v, float))
                return out
            guarded(res, "layers", f"{name}_{n}x{k}", check)


def _new_format_makers(w: torch.Tensor) -> dict:
    """Layer makers (device, dtype) for the formats of issue 34: NVFP4 / MXFP4 weight-only and W4A4, block FP8 W8A8.
    W4A4's input global scale is set for |x| <= 8 (the callers' standard normal inputs), standing in for calibration."""
    import dataclasses

    from llmq import quant
    from llmq.pipeline.quantize.fp4 import quantize_weight
    from llmq.pipeline.quantize.fp8 import quantize_weight_fp8_block
    from llmq.runtime.layers.fp4 import FP4Linear
    from llmq.runtime.layers.fp8_block import BlockFP8Linear

    nv, mx, blk = quantize_weight(w, "nvfp4"), quantize_weight(w, "mxfp4"), quantize_weight_fp8_block(w)
    nv_a = dataclasses.replace(nv, dynamic=True, input_global_scale=quant.nvfp4_global_scale(torch.tensor(8.0)))
    mx_a = dataclasses.replace(mx, dynamic=True)
    return {"nvfp4": lambda d, dt: FP4Linear(nv, None, dt, d), "mxfp4": lambda d, dt: FP4Linear(mx, None, dt, d),
            "nvfp4-w4a4": lambda d, dt: FP4Linear(nv_a, None, dt, d),
            "mxfp4-w4a4": lambda d, dt: FP4Linear(mx_a, None, dt, d),
            "fp8-block": lambda d, dt: BlockFP8Linear(blk, None, dt, d)}


# -- part: layer speed ------------------------------------------------------------------------------------------------
def _device_time(fn, dev: str, reps: int = 30) -> float:
    """Median seconds of fn() (CUDA events on a GPU), after 5 warm-up calls (the first builds Triton kernels)."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        if dev != "cuda":
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def part_layer_speed(args, res: Results, work: Path) -> None:
    """Every weight format's runtime layer on the Llama-3-8B layer's linears, bf16 activations."""
    from llmq import quant
    from llmq.runtime.layers import act_quant as AQ
    from llmq.runtime.layers import linear as L

    dev = args.device
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    if args.small:
        shapes = {k: (n // 16, k_ // 16) for k, (n, k_) in shapes.items()}
    g = torch.Generator().manual_seed(13)
    for lname, (n, k) in shapes.items():
        w = torch.randn(n, k, generator=g) * 0.02
        s4 = w.view(n, k // 128, 128).abs().amax(-1) / 7
        q4 = quant.round_int(w.view(n, k // 128, 128), s4[..., None], bits=4).view(n, k).to(torch.int8)
        s8 = w.abs().amax(-1, keepdim=True) / 127
        q8 = quant.round_int(w, s8).to(torch.int8)
        s_fp8 = w.abs().amax(-1) / quant.FP8_MAX
        w_fp8 = quant.to_fp8(w, s_fp8[:, None])
        makers = {
            "bf16": lambda: L.DenseLinear(w.to(dev, torch.bfloat16), None, torch.bfloat16),
            "int8": lambda: L.Int8WeightOnlyLinear(q8.to(dev), s8.view(-1).to(dev), None, None, torch.bfloat16),
            "int4-g128": lambda: L.Int4WeightOnlyLinear(q4.to(dev), s4.to(dev), None, None, torch.bfloat16),
            "fp8": lambda: AQ.FP8Linear(w_fp8.to(dev), s_fp8.to(dev), None, True, None, torch.bfloat16),
            **{name: (lambda make=make: make(dev, torch.bfloat16)) for name, make in _new_format_makers(w).items()},
        }
        for name, make in makers.items():
            def timed(make=make):
                layer = make()
                out = {"fast": _fast(layer) if name != "bf16" else True, "weight_mib": round(layer.nbytes / 2**20, 1),
                       "why_not": getattr(layer, "fallback_reason", None)}
                for rows in (1, 16, 128):
                    x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
                    with torch.no_grad():
                        t = _device_time(lambda: layer(x), dev)
                    out[f"us_rows{rows}"] = round(t * 1e6, 1)
                    out[f"weight_gbs_rows{rows}"] = round(layer.nbytes / t / 1e9, 1)
                return out
            guarded(res, "layer_speed", f"{lname}_{name}", timed)
    rows = {}
    for name in ("bf16", "int8", "int4-g128", "fp8", "nvfp4", "mxfp4", "fp8-block"):
        for r in (1, 16, 128):
            us = [res.data["layer_speed"].get(f"{ln}_{name}", {}).get(f"us_rows{r}") for ln in shapes]
            base = [res.data["layer_speed"].get(f"{ln}_bf16", {}).get(f"us_rows{r}") for ln in shapes]
            if all(us) and all(base):
                rows[f"{name}_rows{r}"] = {"layer_us": round(sum(us), 1), "x_bf16_speed": round(sum(base) / sum(us), 2)}
    res.put("layer_speed", "summary", rows)


# -- part 2: speed --------------------------------------------------------------------------------------------------
def copy_bandwidth(dev: str) -> float:
    """Bytes read + written per second by a device-to-device copy of 4 GiB (median of 10)."""
    n = (4 << 30) if dev == "cuda" else (256 << 20)
    a = torch.ones(n // 2, dtype=torch.bfloat16, device=dev)
    b = torch.empty_like(a)
    times = []
    for _ in range(12):
        if dev == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        b.copy_(a)
        if dev == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    del a, b
    return 2 * n / sorted(times[2:])[len(times[2:]) // 2]


def part_speed(args, res: Results, work: Path) -> None:
    dev = args.device
    bw = copy_bandwidth(dev)
    res.put("speed", "copy_bandwidth_gbs", round(bw / 1e9, 1))
    src, store, model_art = imported(args, work, LLAMA3_8B, "llama3-8b-random", embed_std=0.02)
    paths = {"bf16": model_art}
    for name, qargs in (("int8", SCHEMES["int8"]), ("int4", ["--method", "rtn", "--bits", "4", "--group-size", "128"])):
        v = guarded(res, "speed_quantize", name, lambda qargs=qargs, name=name: _quantize_fast(store, model_art, qargs,
                                                                                              name, dev))
        if "error" not in v:
            paths[name] = Path(v["path"])
    prompt = make_prompts(1, 128, 32000, seed=9)[0]
    for name, path in paths.items():
        guarded(res, "speed", f"decode_b1_{name}", lambda path=path: _decode(path, prompt, dev, bw))
    prompts = make_prompts(64 * 2, 128, 32000, seed=10)
    levels = [1, 8, 32, 64]
    for name in ("bf16", "int4"):
        if name not in paths:
            continue
        eng = engine(paths[name], dev, max_num_seqs=64, max_num_batched_tokens=4096, kv_cache_memory=8 << 30,
                     max_model_len=512) if not args.small else engine(paths[name], dev)
        for c in levels:
            n = max(4, 2 * c)
            guarded(res, "speed", f"throughput_{name}_c{c}", lambda c=c, n=n, eng=eng: runtime_concurrency(
                eng, prompts[:n], c, 128))
        eng.shutdown()
    if dev == "cuda":
        torch.cuda.empty_cache()
    hf_prompts = prompts[:4]
    guarded(res, "speed", "hf_eager_sequential", lambda: hf_sequential(src, hf_prompts, 128, dev, torch.bfloat16))
    if dev == "cuda":
        guarded(res, "speed", "hf_static_compiled_sequential",
                lambda: hf_sequential(src, hf_prompts, 128, dev, torch.bfloat16, cache_implementation="static"))
    summary(res)


def _quantize_fast(store: Path, model: Path, qargs: list[str], name: str, dev: str) -> dict:
    man = llmq(store, "quantize", str(model), *qargs, "--device", dev, "--probe-tokens", "0", "--name", f"big-{name}")
    m = man["metrics"]
    return {"path": str(artifact_path(store, man)), "wall_s": m["wall_time_s"], "size_bytes": m["size_bytes"],
            "peak_device_bytes": m.get("peak_device_bytes"), "peak_rss_bytes": m["peak_rss_bytes"]}


def _decode(path: Path, prompt: list[int], dev: str, bw: float) -> dict:
    d = batch1_decode(path, prompt, 128, bw, EngineConfig(device=dev, max_num_seqs=1, max_model_len=512,
                                                           kv_cache_memory=1 << 30))
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in d.items()}


def summary(res: Results) -> None:
    s = res.data.get("speed", {})
    out = {}
    b = s.get("decode_b1_bf16", {})
    for name in ("bf16", "int8", "int4"):
        d = s.get(f"decode_b1_{name}", {})
        if "tokens_per_s" in d:
            out[f"decode_b1_{name}"] = {"tok_s": round(d["tokens_per_s"], 1), "mbu": round(d["mbu"], 3),
                                        "x_bf16": round(d["tokens_per_s"] / b["tokens_per_s"], 2)
                                        if "tokens_per_s" in b else None}
    base = {k: s[k]["tokens_per_s"] for k in ("hf_eager_sequential", "hf_static_compiled_sequential")
            if "tokens_per_s" in s.get(k, {})}
    for k, v in s.items():
        if k.startswith("throughput_") and "tokens_per_s" in v:
            out[k] = {"tok_s": round(v["tokens_per_s"], 1),
                      **{f"x_{b_}": round(v["tokens_per_s"] / t, 2) for b_, t in base.items()}}
    res.put("speed", "summary", out)


# -- part 3: GPTQ on the GPU ----------------------------------------------------------------------------------------
def part_gptq(args, res: Results, work: Path) -> None:
    dev = args.device
    _, store, model_art = imported(args, work, LLAMA3_8B, "llama3-8b-random", embed_std=0.02)

    def run():
        t = time.perf_counter()
        man = llmq(store, "quantize", str(model_art), "--method", "gptq", "--bits", "4", "--group-size", "128",
                   "--device", dev, "--num-samples", str(args.gptq_samples), "--seq-len", "512", "--probe-tokens", "0",
                   "--name", "big-gptq")
        m = man["metrics"]
        gib = lambda key: round((m.get(key) or 0) / 2**30, 2)  # noqa: E731
        return {"process_s": round(time.perf_counter() - t, 1), "wall_s": m["wall_time_s"],
                "calibration_tokens": args.gptq_samples * 512, "peak_device_gib": gib("peak_device_bytes"),
                "peak_rss_gib": gib("peak_rss_bytes"), "size_gib": gib("size_bytes")}

    guarded(res, "gptq", "gptq_w4g128", run)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, required=True, help="directory with tokenizer files to give the models")
    ap.add_argument("--out", type=Path, required=True, help="results directory (gpu_check.json)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/llmq-gpu-check"), help="models and store")
    ap.add_argument("--part", nargs="+", default=["correctness", "speed", "gptq"],
                    choices=["layers", "layer_speed", "correctness", "families", "speed", "gptq"])
    ap.add_argument("--only", nargs="*", default=None,
                    help="layers / correctness / families: only these schemes, engine checks or families "
                         "(default: all)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny models, to try the script without a GPU")
    ap.add_argument("--tokens", type=int, default=512, help="positions compared per scheme")
    ap.add_argument("--tie", type=float, default=0.05, help="nats under which a greedy choice is a tie")
    ap.add_argument("--gptq-samples", type=int, default=64, help="GPTQ calibration windows of 512 tokens")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run this on a GPU machine (or try it with --small --device cpu)")
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    res = Results(args.out / "gpu_check.json")
    res.put("env", "torch", {"torch": torch.__version__, "cuda": torch.version.cuda,
                             "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None})
    parts = {"layers": part_layers, "layer_speed": part_layer_speed, "correctness": part_correctness,
             "families": part_families, "speed": part_speed, "gptq": part_gptq}
    for p in args.part:
        t = time.perf_counter()
        parts[p](args, res, args.work)
        res.put("timing", p, round(time.perf_counter() - t, 1))


if __name__ == "__main__":
    main()
