"""Every stage on an 8B-class model on this machine: wall time and peak memory per stage, and 70B on paper.

Not part of CI (the 8B shape writes ~16 GB and runs for an hour or more on two cores). It makes a checkpoint with
random weights and Llama-3-8B's shape (config.json through transformers, bf16 safetensors written a tensor at a
time, so making it needs no 16 GB of RAM), then runs each stage as its own `llmq` process and measures it:

  wall s          the process's wall time
  peak RSS        the kernel's high-water mark of the process (wait4's ru_maxrss, which starts from the parent's RSS at
                  the fork: this script keeps torch out of its own process for that reason)
  peak anon       the largest anonymous memory (RssAnon) of the process tree, sampled every 0.2 s: memory the
                  process owns, without the file pages it reads or writes through the page cache

Stages: import, quantize --bits 4 with rtn / gptq / awq (small calibration, tokens recorded; the KLD probe rides in
quantize), quantize-kv (int8, on the RTN artifact), build --tp 2 for the llmq and trtllm targets, serve of the RTN
artifact answering `llmq bench serve` at concurrency 1 (TPOT, tok/s), bench offline at batch 1 (MBU).
The tokenizer is the default model's (SmolLM2, 49,152 ids), which fits Llama-3's 128,256-row embedding.

    python benchmarks/bench_big_model.py --work /tmp/big            # the 8B shape
    python benchmarks/bench_big_model.py --shape tiny --work /tmp/t # a dry run in a minute
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

SHAPES = {  # Llama-3 8B / 70B, and small ones for dry runs
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=128256),
    "70b": dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                intermediate_size=28672, vocab_size=128256),
    "small": dict(hidden_size=1024, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4,
                  intermediate_size=2816, vocab_size=49152),
    "tiny": dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=512, vocab_size=49152),
}
STAGES = ("import", "rtn", "gptq", "awq", "quantize-kv", "build-llmq", "build-trtllm", "serve", "offline",
          "serve-bf16", "offline-bf16")
MiB = 1 << 20


def _model_name(shape_name: str, layers: int, shape: dict) -> str:
    full = layers == shape["num_hidden_layers"]
    return f"model-{shape_name}" if full else f"model-{shape_name}-{layers}layers"


def layer_params(s: dict) -> int:
    h, kv = s["hidden_size"], s["hidden_size"] // s["num_attention_heads"] * s["num_key_value_heads"]
    return 2 * h * h + 2 * h * kv + 3 * h * s["intermediate_size"] + 2 * h


def model_params(s: dict) -> int:
    return s["num_hidden_layers"] * layer_params(s) + 2 * s["vocab_size"] * s["hidden_size"] + s["hidden_size"]


def make_checkpoint(out: Path, shape: dict, tokenizer_dir: Path, seed: int = 0) -> None:
    """Random bf16 weights (normal, std 0.02; norms 1) in Llama-3's layout, one tensor in memory at a time."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmq.models.checkpoint import ShardedWriter, copy_tokenizer

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cfg = LlamaConfig(**shape, max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, dtype="bfloat16")
    cfg.save_pretrained(tmp)
    with torch.device("meta"):
        names = {k: tuple(v.shape) for k, v in LlamaForCausalLM(cfg).state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    with ShardedWriter(tmp) as w:
        for i, (name, shp) in enumerate(sorted(names.items())):
            t = torch.empty(shp, dtype=torch.bfloat16)
            if name.endswith("norm.weight"):
                t.fill_(1)
            else:
                rows = max(1, (64 * MiB) // (4 * shp[-1]))
                for r in range(0, shp[0], rows):
                    t[r:r + rows] = torch.randn(t[r:r + rows].shape, generator=g) * 0.02
            w.add(name, t)
            print(f"\rwriting {i + 1}/{len(names)} tensors", end="", file=sys.stderr, flush=True)
        w.close()
    print(file=sys.stderr)
    copy_tokenizer(tokenizer_dir, tmp)
    tmp.rename(out)


def disk_needed(shape: dict, short: int, stages: list[str], have_model: bool, have_short: bool, cleanup: bool) -> int:
    """Bytes the stages will write: checkpoints not made yet, the import's copy, an INT4 artifact (plus its
    16-bit embedding and head) per quantize / build stage."""
    def sizes(layers: int) -> tuple[int, int]:
        s = dict(shape, num_hidden_layers=layers)
        return 2 * model_params(s), layers * layer_params(s) // 2 + 4 * s["vocab_size"] * s["hidden_size"]

    (bf16, int4), (sbf16, sint4) = sizes(shape["num_hidden_layers"]), sizes(short)
    need = (0 if have_model else bf16) + ("import" in stages) * bf16
    need += sum(st in stages for st in ("rtn", "build-llmq", "build-trtllm")) * int4
    if {"gptq", "awq"} & set(stages):
        need += (0 if have_short else sbf16) + sbf16 + (1 if cleanup else 2) * sint4
    return need


class Sampler(threading.Thread):
    """Peak RSS / RssAnon of a process and its descendants, every `period` seconds."""

    def __init__(self, pid: int, period: float = 0.2):
        super().__init__(daemon=True)
        self.pid, self.period, self.peak_rss, self.peak_anon, self.done = pid, period, 0, 0, False

    def tree(self) -> list[int]:
        out, todo = [], [self.pid]
        while todo:
            p = todo.pop()
            out.append(p)
            for t in Path(f"/proc/{p}/task").glob("*/children"):
                try:
                    todo += [int(c) for c in t.read_text().split()]
                except OSError:
                    pass
        return out

    def run(self) -> None:
        while not self.done:
            rss = anon = 0
            for p in self.tree():
                try:
                    st = dict(ln.split(":", 1) for ln in Path(f"/proc/{p}/status").read_text().splitlines()
                              if ":" in ln)
                except OSError:
                    continue
                rss += int(st.get("VmRSS", "0 kB").split()[0]) * 1024
                anon += int(st.get("RssAnon", "0 kB").split()[0]) * 1024
            self.peak_rss, self.peak_anon = max(self.peak_rss, rss), max(self.peak_anon, anon)
            time.sleep(self.period)


def run_measured(cmd: list[str], log: Path, until=None) -> dict:
    """Run cmd; with `until(proc)`, run it alongside and then stop the process (a server). Wall time, peaks, rc."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        sampler = Sampler(proc.pid)
        sampler.start()
        extra = {}
        try:
            if until is not None:
                extra = until(proc)
                proc.send_signal(signal.SIGINT)
        finally:
            _, status, usage = os.wait4(proc.pid, 0)
            sampler.done = True
            sampler.join()
    rc = os.waitstatus_to_exitcode(status)
    return dict(extra, cmd=" ".join(cmd[2:]), rc=rc, wall_s=round(time.perf_counter() - t0, 1),
                peak_rss_mib=round(max(usage.ru_maxrss * 1024, sampler.peak_rss) / MiB),
                peak_anon_mib=round(sampler.peak_anon / MiB),
                error=None if rc == 0 or until is not None else _last_line(log))


def _last_line(log: Path) -> str:
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1][:160] if lines else "no output"


def _manifest(store: Path, name: str) -> dict | None:
    versions = sorted((store / name).glob("v*/llmq.json"))
    return json.loads(versions[-1].read_text()) if versions else None


def serve_and_bench(llmq: list[str], port: int, log: Path, timeout: float):
    def until(proc) -> dict:
        url = f"http://127.0.0.1:{port}"
        t0 = time.perf_counter()
        while True:
            if proc.poll() is not None:
                return {"error": f"server exited: {_last_line(log)}"}
            try:
                urllib.request.urlopen(url + "/v1/models", timeout=5).read()
                break
            except OSError:
                if time.perf_counter() - t0 > timeout:
                    return {"error": "server not ready in time"}
                time.sleep(2)
        ready = time.perf_counter() - t0
        out = subprocess.run(llmq + ["bench", "serve", "--endpoint", url, "--concurrency", "1", "--num-prompts", "3",
                                     "--input-len", "64", "--output-len", "32", "--warmup", "1", "--no-save",
                                     "--json"], capture_output=True, text=True)
        if out.returncode:
            return {"error": (out.stderr.strip().splitlines() or ["bench failed"])[-1][:160], "ready_s": ready}
        s = json.loads(out.stdout)["levels"][0]["summary"]
        return {"ready_s": round(ready, 1), "tpot_ms": round(s["tpot"]["p50"] * 1e3, 1),
                "decode_tok_s": round(1 / s["tpot"]["p50"], 2), "ttft_s": round(s["ttft"]["p50"], 2)}
    return until


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=[k for k in SHAPES if k != "70b"], default="8b")
    ap.add_argument("--work", type=Path, required=True, help="directory for the checkpoint and the store")
    ap.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    ap.add_argument("--num-samples", type=int, default=8, help="calibration windows (gptq, awq, quantize-kv)")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per calibration window")
    ap.add_argument("--probe-tokens", type=int, default=256, help="held-out tokens of the KLD probe")
    ap.add_argument("--calib-layers", type=int, default=4,
                    help="gptq / awq run on a checkpoint of this many layers of the same shape (their memory is per "
                         "layer; their wall time for the full depth is extrapolated from the per-layer times); 0: "
                         "the full model")
    ap.add_argument("--layers", type=int, default=None, help=argparse.SUPPRESS)  # with --make-checkpoint
    ap.add_argument("--port", type=int, default=8731)
    ap.add_argument("--cleanup", action="store_true", help="delete the gptq / awq artifacts once measured")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--make-checkpoint", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    shape = SHAPES[a.shape]
    if a.make_checkpoint:
        from llmq.artifacts import Store
        from llmq.models import resolve_model

        tok = resolve_model(None, Store.open(a.work / "store")).path  # the default model: its tokenizer
        layers = a.layers or shape["num_hidden_layers"]
        make_checkpoint(a.work / _model_name(a.shape, layers, shape), dict(shape, num_hidden_layers=layers), tok)
        return 0
    stages = [s.strip() for s in a.stages.split(",") if s.strip()]
    if bad := [s for s in stages if s not in STAGES]:
        print(f"unknown stage(s) {', '.join(bad)}; stages: {', '.join(STAGES)}", file=sys.stderr)
        return 2
    a.work.mkdir(parents=True, exist_ok=True)
    store, model_dir = a.work / "store", a.work / f"model-{a.shape}"

    llmq = [sys.executable, "-m", "llmq", "--store", str(store)]
    depth = shape["num_hidden_layers"]
    short = a.calib_layers if 0 < a.calib_layers < depth else depth
    short_dir = a.work / _model_name(a.shape, short, shape)
    need = disk_needed(shape, short, stages, model_dir.is_dir(), short_dir.is_dir(), a.cleanup)
    free = shutil.disk_usage(a.work).free
    print(f"{a.shape}: {model_params(shape) / 1e9:.2f} B parameters, {2 * model_params(shape) / 2**30:.1f} GiB bf16; "
          f"these stages need about {need / 2**30:.0f} GiB of disk ({free / 2**30:.0f} GiB free)")
    if need > free:
        print("not enough free disk; use --work on a larger disk or --stages to run fewer", file=sys.stderr)
        return 2
    for d, n in ((model_dir, depth), (short_dir, short)):
        if d.is_dir() or (d == short_dir and not {"gptq", "awq"} & set(stages)):
            continue
        t0 = time.perf_counter()  # in a child: this process stays small, as every child starts with its peak RSS
        subprocess.run([sys.executable, __file__, "--make-checkpoint", "--shape", a.shape, "--layers", str(n),
                        "--work", str(a.work)], check=True)
        print(f"checkpoint {d.name} written in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    calib = ["--num-samples", str(a.num_samples), "--seq-len", str(a.seq_len)]
    rtn = f"big-{a.shape}-rtn"
    commands = {
        "import": ["import", str(model_dir)],
        "rtn": ["quantize", str(model_dir), "--bits", "4", "--method", "rtn", "--probe-tokens", str(a.probe_tokens),
                "--name", rtn],
        "gptq": ["quantize", str(short_dir), "--bits", "4", "--method", "gptq", *calib, "--probe-tokens",
                 str(a.probe_tokens), "--name", f"big-{a.shape}-gptq"],
        "awq": ["quantize", str(short_dir), "--bits", "4", "--method", "awq", *calib, "--probe-tokens",
                str(a.probe_tokens), "--name", f"big-{a.shape}-awq"],
        "quantize-kv": ["quantize-kv", rtn, "--kv", "int8", *calib, "--probe-tokens", str(a.probe_tokens),
                        "--name", f"{rtn}-kvint8"],
        "build-llmq": ["build", rtn, "--tp", "2", "--target", "llmq", "--name", f"{rtn}-tp2"],
        "build-trtllm": ["build", rtn, "--tp", "2", "--target", "trtllm", "--name", f"{rtn}-tp2-trtllm"],
        "serve": ["serve", rtn, "--port", str(a.port), "--kv-cache-memory", "1GiB", "--max-batch-size", "4"],
        "offline": ["bench", "offline", rtn, "--batch-sizes", "1", "--input-len", "64", "--output-len", "16",
                    "--name", f"bench-{rtn}"],
    }
    commands["serve-bf16"] = commands["serve"] + ["--dtype", "bfloat16"]
    commands["offline-bf16"] = commands["offline"][:-1] + [f"bench-{rtn}-bf16", "--dtype", "bfloat16"]
    results = {}  # resumed: stages measured by an earlier run with the same --json stay in the table
    if a.json and a.json.is_file():
        results = json.loads(a.json.read_text()).get("stages", {})
    for st in stages:
        print(f"[{time.strftime('%H:%M:%S')}] {st}: llmq {' '.join(commands[st])}", file=sys.stderr, flush=True)
        until = serve_and_bench(llmq, a.port, a.work / f"{st}.log", 3600) if st.startswith("serve") else None
        r = run_measured(llmq + commands[st], a.work / f"{st}.log", until)
        name = commands[st][commands[st].index("--name") + 1] if "--name" in commands[st] else None
        m = _manifest(store, name) if name else None
        if m and st in ("rtn", "gptq", "awq"):
            probe = m["metrics"].get("probe") or {}
            times = m["metrics"]["layer_times_s"]
            r.update(kld=probe.get("kld_mean"), top1=probe.get("top1"), size_gib=m["metrics"]["size_bytes"] / 2**30,
                     calib_tokens=0 if st == "rtn" else a.num_samples * a.seq_len,
                     layer_s=sorted(times)[len(times) // 2], layers=len(times))
            if len(times) < depth:  # the same stage at full depth: the rest + every layer at the measured median
                r["wall_s_full_depth"] = round(r["wall_s"] - sum(times) + depth * r["layer_s"], 1)
        if m and st == "quantize-kv":
            r.update(kld=m["metrics"]["probe"].get("kld_mean"), calib_tokens=a.num_samples * a.seq_len)
        if st.startswith("offline"):
            rep = sorted((store / name).glob("v*/report.json"))
            if rep:
                row = json.loads(rep[-1].read_text())["offline"][0]
                r.update(decode_tok_s=round(row["tokens_per_s"], 2), mbu=row["mbu"],
                         weight_gib=row["weight_bytes"] / 2**30)
        if st in ("rtn", "gptq", "awq") and a.cleanup and st != "rtn" and name:
            shutil.rmtree(store / name, ignore_errors=True)
        results[st] = r
        print(f"    -> {json.dumps({k: v for k, v in r.items() if k != 'cmd'})}", file=sys.stderr, flush=True)
        if a.json:  # after every stage: a run cut short keeps what it measured
            a.json.write_text(json.dumps({"shape": a.shape, "config": shape, "stages": results}, indent=2))
    small = {}
    if a.shape != "tiny":  # the fixed part of each stage, for the estimate on paper
        out = a.work / "tiny.json"
        small = json.loads(out.read_text())["stages"] if out.is_file() else {}
        if any(st not in small or small[st].get("error") for st in results):  # every stage: later ones need rtn
            subprocess.run([sys.executable, __file__, "--shape", "tiny", "--work", str(a.work / "tiny"), "--stages",
                            ",".join(st for st in STAGES if st in results), "--json", str(out),
                            "--port", str(a.port + 1)], capture_output=True)
            small = json.loads(out.read_text())["stages"] if out.is_file() else {}
    print_table(a.shape, shape, results)
    if small:
        print_paper(shape, results, small)
    if a.json:
        a.json.write_text(json.dumps({"shape": a.shape, "config": shape, "stages": results, "tiny": small},
                                     indent=2))
    return 0


def _notes(r: dict) -> str:
    keys = ("layers", "wall_s_full_depth", "kld", "top1", "calib_tokens", "size_gib", "layer_s", "tpot_ms",
            "decode_tok_s", "mbu", "ready_s", "error")
    out = []
    for k in keys:
        v = r.get(k)
        if v is not None:
            out.append(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}")
    return ", ".join(out)


def print_table(name: str, shape: dict, results: dict) -> None:
    print(f"\n{name}: {model_params(shape) / 1e9:.2f} B parameters, bf16 {2 * model_params(shape) / 2**30:.1f} GiB")
    print(f"{'stage':<13} {'wall s':>8} {'peak RSS MiB':>13} {'peak anon MiB':>14}  notes")
    for st, r in results.items():
        print(f"{st:<13} {r['wall_s']:>8.1f} {r['peak_rss_mib']:>13} {r['peak_anon_mib']:>14}  {_notes(r)}")


def print_paper(shape: dict, results: dict, small: dict) -> None:
    """70B on paper, a two-point model per stage: what the tiny shape's run of the same stage needs is the fixed part
    (interpreter, libraries, calibration text, tokenizer), and the rest of this shape's peak grows like one decoder
    layer (70B's is 3.9x the 8B's; conservative for the embedding-sized parts, which grow 2x). Serve, offline and
    quantize-kv (the runtime) hold the whole INT4 model: their rest grows like the model."""
    big = SHAPES["70b"]
    layer_ratio = layer_params(big) / layer_params(shape)
    model_ratio = model_params(big) / model_params(shape)
    print(f"\nLlama-3-70B on paper ({model_params(big) / 1e9:.1f} B parameters; a decoder layer {layer_ratio:.2f}x "
          f"this shape's, the model {model_ratio:.2f}x; fixed part: the same stage on the tiny shape)")
    print(f"{'stage':<13} {'tiny MiB':>9} {'this MiB':>9} {'70B est. MiB':>13}   (peak anonymous memory)")
    for st, r in results.items():
        base = small.get(st, {}).get("peak_anon_mib")
        if r.get("error") or not r["peak_anon_mib"] or not base or small[st].get("error"):
            continue
        ratio = model_ratio if st.startswith(("serve", "offline", "quantize-kv")) else layer_ratio
        est = base + max(0.0, r["peak_anon_mib"] - base) * ratio
        print(f"{st:<13} {base:>9} {r['peak_anon_mib']:>9} {est:>13.0f}")


if __name__ == "__main__":
    sys.exit(main())
