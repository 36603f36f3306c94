"""llmq eval: LM numerics vs transformers, task data, sandbox, gates and CI math, baseline cache, the CLI."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner
from helpers import make_tiny_model

from llmq.artifacts import Store
from llmq.cli.main import cli
from llmq.errors import GateFailed, LlmqError
from llmq.models import qformat, resolve_model
from llmq.models.checkpoint import copy_tokenizer, load_state_dict, read_config, save_state_dict, write_json

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# -- helpers --------------------------------------------------------------------------------------------------------
def rtn(w: torch.Tensor, bits: int) -> qformat.QuantizedWeight:
    """Per-output-channel symmetric round-to-nearest: the crude baseline quantizer."""
    w = w.float()
    qmax = 2 ** (bits - 1) - 1
    scale = (w.abs().amax(dim=1, keepdim=True) / qmax).clamp_min(1e-8)
    q = (w / scale).round().clamp(-qmax - 1, qmax).to(torch.int8)
    return qformat.QuantizedWeight(q=q, scale=scale.to(torch.bfloat16), zero_point=None, bits=bits, group_size=None,
                                   symmetric=True)


def make_rtn(store: Store, model, bits: int, name: str):
    """A quantized artifact (compressed-tensors pack-quantized, via qformat) of `model`, its lineage parent."""
    out = {}
    for k, v in load_state_dict(model.path).items():
        if k.endswith(".weight") and k.split(".")[-2] in LINEARS:
            out.update(qformat.write_linear(k[:-len(".weight")], rtn(v, bits)))
        else:
            out[k] = v
    cfg = read_config(model.path)
    cfg["quantization_config"] = qformat.quantization_config(qformat.QuantArgs(num_bits=bits, strategy="channel"))
    with store.create("quantized", name, parents=[model.id], config={"method": "rtn", "bits": bits}) as w:
        save_state_dict(out, w.dir)
        write_json(w.dir / "config.json", cfg)
        copy_tokenizer(model.path, w.dir)
        if (model.path / "generation_config.json").is_file():
            shutil.copyfile(model.path / "generation_config.json", w.dir / "generation_config.json")
    return w.artifact


def req(*args):
    return SimpleNamespace(args=args)


@pytest.fixture(scope="module")
def tiny_dir(tiny_model):
    return tiny_model(seed=3)


@pytest.fixture(scope="module")
def lms(tiny_dir):
    from llmq.evals.lm import HFLM, LlmqLM
    from llmq.runtime.engine import EngineConfig

    # a small step budget so long items are chunked across steps and share steps with others
    ours = LlmqLM(tiny_dir, engine_config=EngineConfig(max_num_seqs=8, max_num_batched_tokens=96,
                                                       kv_cache_memory=8 << 20))
    yield ours, HFLM(tiny_dir)
    ours.close()


@pytest.fixture(scope="module")
def reference(tiny_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float64).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].log_softmax(-1)

    return logprobs


def rand_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("abcdefghij klmnop\nqrs=+0123456789") for _ in range(n))


# -- LM numerics ----------------------------------------------------------------------------------------------------
def test_loglikelihood_matches_transformers(lms, reference):
    ours, hf = lms
    rng = random.Random(7)
    shared = rand_text(rng, 120)  # a few-shot-like prefix shared by many requests
    requests = []
    for i in range(14):
        ctx = (shared if i % 2 else "") + rand_text(rng, rng.randint(1, 300))
        for _ in range(rng.randint(1, 4)):  # several continuations of one context, like multiple choice
            requests.append(req(ctx, rand_text(rng, rng.randint(1, 20))))
    requests.append(req("", "no context at all"))
    got, got_hf = ours.loglikelihood(requests), hf.loglikelihood(requests)
    tok = ours.tokenizer
    for r, (lp, greedy), (lp_hf, _) in zip(requests, got, got_hf):
        ctx = tok.encode(r.args[0], add_special_tokens=False) or [ours.prefix_token_id]
        cont = tok.encode(r.args[1], add_special_tokens=False)
        lsm = reference(ctx + cont)[len(ctx) - 1:-1]
        target = torch.tensor(cont)
        want = float(lsm.gather(1, target[:, None]).sum())
        assert lp == pytest.approx(want, abs=2e-4 * len(cont) + 1e-4)
        assert lp_hf == pytest.approx(want, abs=2e-4 * len(cont) + 1e-4)
        assert greedy == bool((lsm.argmax(-1) == target).all())
    assert ours.score_stats["reused_tokens"] > 0  # shared prefixes came from the prefix cache, still exact


def test_loglikelihood_rolling_matches(lms, reference):
    ours, hf = lms
    rng = random.Random(11)
    texts = [rand_text(rng, n) for n in (5, 300, 1300)]  # the last spans several 511-token windows
    got, got_hf = ours.loglikelihood_rolling([req(t) for t in texts]), hf.loglikelihood_rolling([req(t) for t in texts])
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    for text, lp, lp_hf in zip(texts, got, got_hf):
        ids = ours.tokenizer.encode(text, add_special_tokens=False)
        want = 0.0  # lm-eval's disjoint windows (inputs + last target fit the context), scored in float64
        for ctx, pred in map(make_disjoint_window, get_rolling_token_windows(ids, ours.prefix_token_id,
                                                                             ours.max_length - 1, 1)):
            lsm = reference(ctx + pred)[len(ctx) - 1:-1]
            want += float(lsm.gather(1, torch.tensor(pred)[:, None]).sum())
        assert lp == pytest.approx(want, abs=2e-4 * len(ids))
        assert lp_hf == pytest.approx(want, abs=2e-4 * len(ids))


def test_generate_until_stops_at_stop_strings(lms):
    ours, hf = lms
    prompts = ["1 + 1 = 2\n3 + 4 =", "hello world", "def f(x):\n    return"]
    free = ours.generate_until([req(p, {"max_gen_toks": 40, "until": []}) for p in prompts])
    stops = []
    for text in free:
        assert len(text) >= 6
        stops.append(text[3:5])
    cut = ours.generate_until([req(p, {"max_gen_toks": 40, "until": [s, "\x00never"]})
                               for p, s in zip(prompts, stops)])
    for text, s, c in zip(free, stops, cut):
        assert c == text[:text.find(s)]
        assert s not in c
    hf_cut = hf.generate_until([req(p, {"max_gen_toks": 40, "until": [s]}) for p, s in zip(prompts, stops)])
    for c, s in zip(hf_cut, stops):
        assert s not in c


# -- task data ------------------------------------------------------------------------------------------------------
def test_task_data_is_deterministic(tmp_path):
    from llmq.evals.tasks import materialize

    a = materialize(tmp_path / "a", seed=5)
    b = materialize(tmp_path / "b", seed=5)
    c = materialize(tmp_path / "c", seed=6)
    assert a.info == b.info
    assert a.info["fingerprint"] != c.info["fingerprint"]
    for p in sorted(a.include_path.glob("*.jsonl")):
        assert p.read_bytes() == (b.include_path / p.name).read_bytes()
    assert (a.include_path / "arith_mc.jsonl").read_bytes() != (c.include_path / "arith_mc.jsonl").read_bytes()
    assert {"llmq_arith_mc", "llmq_arith_gen", "llmq_code_nextline", "llmq_code_greedy", "llmq_code_bpb",
            "llmq_ppl"} <= set(a.available)
    assert a.info["stdlib_files"]  # which source files the code data came from is recorded
    for line in (a.include_path / "arith_mc.jsonl").read_text().splitlines():
        d = json.loads(line)
        x, y = (int(v) for v in d["question"].rstrip(" =").split(" + "))
        assert d["choices"][d["label"]] == str(x + y)
        assert len(set(d["choices"])) == 4
    for line in (a.include_path / "code_nextline.jsonl").read_text().splitlines()[:50]:
        d = json.loads(line)
        rel, i = d["source"].rsplit(":", 1)
        assert len(set(d["choices"])) == 4
        assert d["context"].endswith("\n")


def test_code_tasks_never_score_the_quantizers_calibration_text():
    from llmq.evals.tasks import STDLIB_FILES
    from llmq.pipeline.quantize.calib import CALIB_STDLIB

    assert not set(STDLIB_FILES) & set(CALIB_STDLIB)


def test_code_greedy_asks_for_the_true_next_line_of_the_source(tmp_path):
    import sysconfig

    from lm_eval.tasks import TaskManager, get_task_dict

    from llmq.evals.tasks import materialize

    ts = materialize(tmp_path, seed=5)
    task = get_task_dict(["llmq_code_greedy"], TaskManager(include_path=str(ts.include_path),
                                                           include_defaults=False))["llmq_code_greedy"]
    assert task.OUTPUT_TYPE == "loglikelihood"
    for doc in list(task.test_docs())[:20]:
        rel, i = doc["source"].rsplit(":", 1)
        src = (Path(sysconfig.get_paths()["stdlib"]) / rel).read_text(encoding="utf-8")
        lines = [ln for ln in src.splitlines() if ln.strip()]
        assert task.doc_to_text(doc) == "\n".join(lines[int(i) - 8:int(i)]) + "\n"
        head = task.doc_to_target(doc)  # the real next line's indentation and first word, scored for a greedy match
        assert lines[int(i)].startswith(head)
        assert head.strip()
    assert task.process_results(doc, [(-3.0, True)]) == {"acc": 1}
    assert task.process_results(doc, [(-3.0, False)]) == {"acc": 0}


# -- sandbox --------------------------------------------------------------------------------------------------------
def test_sandbox_limits(tmp_path):
    from llmq.evals.sandbox import run_sandboxed

    assert run_sandboxed("print(6 * 7)").stdout.strip() == "42"
    assert run_sandboxed("assert 1 == 2").status == "failed"
    t = time.monotonic()
    loop = run_sandboxed("while True: pass", timeout=20, cpu_s=2)
    assert loop.status in ("killed", "timeout")
    assert time.monotonic() - t < 15
    t = time.monotonic()
    loop = run_sandboxed("import time\nwhile True: time.sleep(1)", timeout=2, cpu_s=2)  # no CPU used: wall timeout
    assert loop.status == "timeout"
    assert time.monotonic() - t < 10
    bomb = run_sandboxed("a = []\nwhile True: a.append(bytearray(10**7))", memory_mb=256, timeout=20)
    assert not bomb.passed
    assert "MemoryError" in bomb.stderr or bomb.status == "killed"
    outside = tmp_path / "escaped.txt"
    for code in (f"open({str(outside)!r}, 'w').write('x')",
                 f"import os; os.close(os.open({str(outside)!r}, os.O_WRONLY | os.O_CREAT))",
                 f"import shutil; shutil.copy('program.py', {str(outside)!r})",
                 f"import subprocess; subprocess.run(['touch', {str(outside)!r}])"):
        assert not run_sandboxed(code).passed
    assert not outside.exists()
    inside = run_sandboxed("open('f.txt', 'w').write('ok'); print(open('f.txt').read())")
    assert inside.passed
    assert inside.stdout.strip() == "ok"
    net = run_sandboxed("import socket; socket.create_connection(('127.0.0.1', 9), timeout=1)")
    assert not net.passed


def _host_processes_with(token: str) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if token.encode() in cmdline.read_bytes():
                found.append(cmdline.parent.name)
        except OSError:
            pass
    return found


_OUTSIDE = ("/root/llmq-sandbox-escape", "/usr/lib/llmq-sandbox-escape", "/llmq-sandbox-escape")


def test_sandbox_confines_files_and_mounts(tmp_path):
    """Issue 13: writes outside the private /tmp, remounting / read-write (directly or in a nested user namespace),
    reading /etc/shadow and rewriting the old in-process deny list all fail, run for real."""
    from llmq.evals.sandbox import run_sandboxed

    outside = [*_OUTSIDE, str(tmp_path / "escaped.txt")]
    for path in outside:
        assert not run_sandboxed(f"open({path!r}, 'w').write('x')").passed
    shadow = run_sandboxed("print(open('/etc/shadow').read())")
    assert not shadow.passed
    assert "root:" not in shadow.stdout
    mount = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
             "assert libc.mount(b'none', b'/', None, 32 | 4096, None) == 0, ctypes.get_errno()  # remount, bind\n"
             f"open({_OUTSIDE[0]!r}, 'w').write('x')\n")
    assert not run_sandboxed(mount).passed
    nested = mount.replace("assert libc.mount", "assert libc.unshare(0x10000000 | 0x20000) == 0\nassert libc.mount")
    assert not run_sandboxed(nested).passed
    rewrite = ("import sys\nm = sys.modules['__main__']\n"
               "for name in ('_DENY', '_PATHS'):\n    setattr(m, name, ())\nm._ROOT = '/'\nm._inside = lambda p: True\n"
               f"open({_OUTSIDE[0]!r}, 'w').write('x')\n")
    assert not run_sandboxed(rewrite).passed
    children = ("import subprocess, sys\n"  # subprocess starts children through _posixsubprocess.fork_exec
                f"subprocess.run([sys.executable, '-c', 'open({_OUTSIDE[0]!r}, \"w\")'], check=True)\n")
    assert not run_sandboxed(children).passed
    reader = "import subprocess, sys\nsubprocess.run([sys.executable, '-c', 'open(\"/etc/shadow\")'], check=True)\n"
    assert not run_sandboxed(reader).passed
    assert not any(Path(p).exists() for p in outside)
    legit = run_sandboxed("import subprocess, sys\nprint(subprocess.run([sys.executable, '-c', 'print(6 * 7)'], "
                          "capture_output=True, text=True).stdout.strip())")
    assert legit.passed
    assert legit.stdout.strip() == "42"


def test_sandbox_has_no_network():
    """A server listening on the host's 127.0.0.1 is unreachable from inside (own network namespace)."""
    import socket

    from llmq.evals.sandbox import run_sandboxed

    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        socket.create_connection(("127.0.0.1", port), timeout=2).close()  # reachable from the host
        net = run_sandboxed(f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)")
    assert not net.passed
    assert "ConnectionRefused" in net.stderr


def test_sandbox_kills_setsid_children():
    """A child that calls setsid() dies with the program: at the timeout, and when the program exits first."""
    from llmq.evals.sandbox import run_sandboxed

    def program(token: str, parent: str) -> str:
        return ("import os, sys, time\nif os.fork() == 0:\n    os.setsid()\n"
                f"    os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', {token!r}])\n"
                f"{parent}\n")

    token = f"llmq-setsid-{os.getpid()}-a"
    t = time.monotonic()
    r = run_sandboxed(program(token, "time.sleep(60)"), timeout=3)
    assert r.status == "timeout"
    assert time.monotonic() - t < 3 + 3
    time.sleep(0.5)
    assert _host_processes_with(token) == []
    token = token[:-1] + "b"
    t = time.monotonic()
    r = run_sandboxed(program(token, "time.sleep(0.5)\nprint('done')"), timeout=20)
    assert r.passed
    assert r.stdout.strip() == "done"
    assert time.monotonic() - t < 5
    time.sleep(0.5)
    assert _host_processes_with(token) == []


def test_code_execution_refused_without_bubblewrap(monkeypatch, tmp_path):
    from llmq.evals.runner import EvalOptions
    from llmq.evals.sandbox import run_sandboxed

    monkeypatch.setenv("PATH", str(tmp_path))
    for call in (lambda: run_sandboxed("print(1)"), lambda: EvalOptions(allow_code_execution=True).check()):
        with pytest.raises(LlmqError, match=
                           r"^--allow-code-execution needs bubblewrap.*apt-get install -y bubblewrap$"):
            call()


def test_humaneval_scoring_runs_in_the_sandbox(tmp_path, monkeypatch):
    import llmq.evals.tasks.humaneval as he
    from llmq.evals.tasks import materialize

    doc = {"task_id": "t/0", "prompt": "def add(a, b):\n", "test": "def check(f):\n    assert f(2, 3) == 5\n",
           "entry_point": "add"}
    assert he.process_results(doc, ["    return a + b\n"]) == {"pass@1": 1.0}
    assert he.process_results(doc, ["    return a - b\n"]) == {"pass@1": 0.0}
    assert he.process_results(doc, ["    while True:\n        pass\n"]) == {"pass@1": 0.0}
    monkeypatch.setattr(he, "humaneval_rows", lambda: [doc])
    assert "llmq_humaneval" not in materialize(tmp_path, seed=1).available  # only with --allow-code-execution
    ts = materialize(tmp_path, seed=1, allow_code_execution=True)
    from lm_eval.tasks import TaskManager, get_task_dict

    task = get_task_dict(["llmq_humaneval"], TaskManager(include_path=str(ts.include_path),
                                                         include_defaults=False))["llmq_humaneval"]
    assert task.process_results(doc, ["    return a + b\n"]) == {"pass@1": 1.0}


# -- gates and statistics -------------------------------------------------------------------------------------------
def test_gate_parsing_and_checks():
    from llmq.evals.gate import Gate, check_gates, enforce, parse_gates

    gates = parse_gates("math>=-2.0, code>=-2,kld<=0.05,top1>90")
    assert gates == [Gate("math", ">=", -2.0), Gate("code", ">=", -2.0), Gate("kld", "<=", 0.05),
                     Gate("top1", ">", 90.0)]
    for bad in ("math", "math=>1", "math>=x", "kld<<1", ","):
        with pytest.raises(LlmqError):
            parse_gates(bad)
    report = {"baseline": {"ref": "b"}, "kld": {"mean": 0.04, "p99": 0.5, "top1": 95.0},
              "deltas": {"math": {"delta": -3.5, "ci95": [-6, -1], "unit": "points"},
                         "code": {"delta": 1.0, "ci95": [-1, 3], "unit": "points"}}}
    results = check_gates(gates, report)
    assert [r.passed for r in results] == [False, True, True, True]
    with pytest.raises(GateFailed) as e:
        enforce(results)
    assert "math>=-2" in str(e.value)
    assert "code" not in str(e.value)
    assert e.value.exit_code == 1
    assert not check_gates(parse_gates("ppl<=1"), report)[0].passed  # a score that was not computed fails


def test_confidence_interval_math():
    from llmq.evals.compare import Z95, delta, group_scores, mean_stderr, ratio_stderr

    rng = random.Random(3)
    vals = [float(rng.random() < 0.6) for _ in range(200)]
    m, se = mean_stderr(vals)
    assert m == pytest.approx(statistics.fmean(vals))
    assert se == pytest.approx(statistics.stdev(vals) / math.sqrt(200))
    d = delta({"value": 40.0, "stderr": 3.0, "unit": "points"}, {"value": 70.0, "stderr": 4.0, "unit": "points"})
    assert d["delta"] == -30.0
    assert d["stderr"] == pytest.approx(5.0)
    assert d["ci95"] == pytest.approx([-30 - Z95 * 5, -30 + Z95 * 5])
    x, y = [rng.uniform(1, 5) for _ in range(50)], [rng.uniform(2, 9) for _ in range(50)]
    r, rse = ratio_stderr(x, y)
    assert r == pytest.approx(sum(x) / sum(y))
    # the delta-method standard error agrees with a bootstrap of the same ratio
    boots = []
    for _ in range(3000):
        idx = [rng.randrange(50) for _ in range(50)]
        boots.append(sum(x[i] for i in idx) / sum(y[i] for i in idx))
    assert rse == pytest.approx(statistics.stdev(boots), rel=0.15)
    g = group_scores({"a": {"task": "a", "value": 60.0, "stderr": 3.0, "unit": "points"},
                      "b": {"task": "b", "value": 20.0, "stderr": 4.0, "unit": "points"},
                      "c": {"task": "c", "value": 1.1, "stderr": 0.1, "unit": "bits/byte"}}, {"g": ("a", "b", "c")})
    assert g["g"]["value"] == 40.0
    assert g["g"]["stderr"] == pytest.approx(2.5)
    assert g["g"]["tasks"] == ["a", "b"]


# -- the CLI on tiny models: gates, exit codes, baseline cache, determinism -------------------------------------------
def test_cli_gate_fails_with_exit_1_and_baseline_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMQ_CACHE", str(tmp_path / "cache"))
    store = Store(tmp_path / "store")
    base = resolve_model(str(make_tiny_model(tmp_path / "base", seed=0)), store)
    cand = make_rtn(store, base, 4, "tiny-rtn4")
    runner = CliRunner()
    args = ["--store", str(store.root), "eval", cand.ref, "--tasks", "math,ppl,kld", "--limit", "3", "--json",
            "--gate", "math>=-1000,kld<=-1,ppl<=-1e9"]
    first = runner.invoke(cli, args)
    assert first.exit_code == 1, first.output
    assert "gate failed: kld<=-1" in first.output
    assert "ppl<=-1e+09" in first.output
    assert "math>=-1000" not in first.output.split("gate failed:")[1]
    rep1 = json.loads(first.output[first.output.index("{"):first.output.rindex("}") + 1])
    assert rep1["baseline"]["id"] == base.id
    assert rep1["kld"]["mean"] > 0
    assert rep1["scores"]["tasks"]["llmq_arith_mc"]["stderr"] is not None
    assert set(rep1["deltas"]) >= {"math", "llmq_arith_mc", "llmq_ppl"}
    second = runner.invoke(cli, args)
    assert second.exit_code == 1
    rep2 = json.loads(second.output[second.output.index("{"):second.output.rindex("}") + 1])
    assert rep2["scores"] == rep1["scores"]
    assert rep2["kld"] == rep1["kld"]  # the same eval twice: identical
    reports = store.list(kind="eval-report")
    assert len(reports) == 3  # the baseline's own report once, the candidate's twice
    cand_rep = [r for r in reports if r.parents == [cand.id, base.id]]
    assert len(cand_rep) == 2
    assert (cand_rep[0].path / "report.md").read_text().startswith("# llmq eval")
    assert cand_rep[0].id == cand_rep[1].id  # identical payloads: timings live in the manifest's metrics
    m1, m2 = cand_rep[0].metrics, cand_rep[1].metrics
    assert m1["baseline_scores_cached"] is False
    assert m1["wall_s"] > 0
    assert m2["baseline_scores_cached"] is True  # computed once, read back from the baseline's own report
    assert m2["baseline_scores_from"] == m1["baseline_scores_from"]
    ok = runner.invoke(cli, ["--store", str(store.root), "eval", cand.ref, "--tasks", "math,ppl", "--limit", "3",
                             "--gate", "math>=-1000"])
    assert ok.exit_code == 0, ok.output
    assert "baseline scores reused" in ok.output
    assert "the root model" in ok.output
    bad = runner.invoke(cli, ["--store", str(store.root), "eval", cand.ref, "--gate", "math=>1"])
    assert bad.exit_code == 2
    assert "bad gate" in bad.output


# -- integration: the default model, INT4 / INT8 RTN (`llmq quantize`) vs bf16 -----------------------------------------
@pytest.mark.integration
def test_int4_rtn_loses_against_bf16(default_model, default_store, default_int4, default_int8, tmp_path,
                                     monkeypatch):
    from llmq.evals.evaluate import default_baseline, run_eval
    from llmq.evals.gate import parse_gates
    from llmq.evals.runner import EvalSettings

    monkeypatch.setenv("LLMQ_CACHE", str(tmp_path / "cache"))
    model, store, int4, int8 = default_model, default_store, default_int4, default_int8
    assert default_baseline(store, int4).id == model.id
    r4 = run_eval(store, int4, model, EvalSettings(tasks=["math", "code", "kld"], limit=16, seed=1234),
                  parse_gates("math>=-2.0")).report
    d = r4["deltas"]
    assert d["math"]["delta"] < 0
    assert d["math"]["stderr"] > 0
    assert d["llmq_code_bpb"]["delta"] > 0
    assert d["llmq_code_bpb"]["stderr"] > 0  # code got worse
    assert "code" in d
    assert d["code"]["stderr"] > 0
    assert r4["gates"][0]["passed"] is False
    r8 = run_eval(store, int8, model, EvalSettings(tasks=["kld"], limit=4, seed=1234), []).report  # 100x apart
    assert r4["kld"]["mean"] > r8["kld"]["mean"] > 0
    assert r4["kld"]["top1"] < r8["kld"]["top1"]


def test_a_non_finite_kld_fails_loudly():
    """NaN / inf logits made "mean KLD nan, top-1 100.00%" (issue 36, item 7), which a top1 gate would pass: the
    probe and the eval's KLD both raise instead; entries the baseline masks to -inf on both sides are no fault."""
    import torch

    from llmq.errors import LlmqError
    from llmq.evals.kld import token_kl
    from llmq.pipeline.quantize.probe import ProbeAccumulator, kld_top1

    p = torch.randn(6, 32)
    for bad in (float("nan"), float("inf")):
        q = p.clone()
        q[2, 5] = bad
        with pytest.raises(LlmqError, match="not finite"):
            kld_top1(p, q)
        with pytest.raises(LlmqError, match="not finite"):
            ProbeAccumulator().add(p, q)
        with pytest.raises(LlmqError, match="not finite"):
            token_kl(q.log_softmax(-1), p.log_softmax(-1))
    masked = p.clone()
    masked[:, -4:] = float("-inf")  # padded vocabulary entries
    kl, agree = token_kl(masked.log_softmax(-1), masked.log_softmax(-1))
    assert torch.equal(kl, torch.zeros(6))
    assert bool(agree.all())


def test_the_kl_histogram_counts_every_position_in_its_bin():
    """The per-position KL histogram the probe and eval's kld record: numpy's histogram over the same edges (values
    below the first inner edge in the first bin, above the last in the last), the probe's counts summed over chunks
    equal to one count of all positions."""
    import numpy as np
    import torch

    from llmq.evals.kld import KL_EDGES, kl_counts
    from llmq.pipeline.quantize.probe import ProbeAccumulator, _terms, positions_per_chunk

    kl = torch.cat([torch.zeros(3), 10 ** (torch.rand(500, dtype=torch.float64) * 10 - 7), torch.tensor([1e3])])
    want, _ = np.histogram(np.clip(kl.numpy(), 0, KL_EDGES[-1]), bins=np.array(KL_EDGES))
    assert kl_counts(kl) == want.tolist()
    assert sum(kl_counts(kl)) == kl.numel()
    p, q = torch.randn(1200, 8192), torch.randn(1200, 8192)
    assert positions_per_chunk(8192) < 600
    acc = ProbeAccumulator()
    acc.add(p, q)   # in chunks of positions_per_chunk
    assert acc.result()["histogram"]["counts"] == kl_counts(_terms(p, q)[0])
