"""`llmq deploy`: the sizing arithmetic against hand computations, refusals (layouts that cannot fit, artifacts an
engine cannot load), every engine's commands on one node and several, their flag names against the engines' own
argument parsers (tests/data/deploy_engine_flags.json), vLLM's KServe and Ray Serve files against KServe's CRD schema
and Ray's models (tests/data/deploy_serving_schemas.json), and the deploy artifact written through the store."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import yaml

from llmq.errors import LlmqError
from llmq.models.spec import ModelSpec
from llmq.pipeline.deploy import ENGINES, GPUS, DeployOptions, deploy
from llmq.pipeline.deploy.manifests import KSERVE_FILE, RAY_FILE
from llmq.pipeline.deploy.sizing import ACTIVATION_MARGIN, MEMORY_FRACTION, Load, choose, size, smallest

DATA = Path(__file__).parent / "data"
FLAGS = json.loads((DATA / "deploy_engine_flags.json").read_text())
SCHEMAS = json.loads((DATA / "deploy_serving_schemas.json").read_text())
H100_USABLE = int(81559 * 2**20 * 0.9)
TINY = dict(model_type="llama", vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
# SmolLM2-135M-Instruct, the default model: 30 layers, 9 query / 3 KV heads of 64, tied embeddings
SMOLLM2 = dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True)
across_nodes, one_node = ENGINES["vllm"].to_ranks, ENGINES["llama.cpp"].to_ranks


def test_sizing_of_a_tiny_model_by_hand():
    spec = ModelSpec.from_config(TINY)
    load = Load(spec, weight_bytes=1_000_001, kv_element_bytes=2, context=512, concurrency=32)
    one = size(load, "h100", 1, 1, 1, 1)
    # KV: K and V x 2 layers x 2 KV heads x 16 x 2 bytes = 256 bytes a token, x 512 tokens x 32 sequences
    assert (one.weights, one.kv_cache, one.margin) == (1_000_001, 256 * 512 * 32, ACTIVATION_MARGIN)
    assert one.usable == H100_USABLE
    assert MEMORY_FRACTION == 0.9
    four = size(load, "h100", 2, 2, 2, 2)
    # tp 2: one KV head a rank; pp 2: one layer a stage -> 2 x 1 x 1 x 16 x 2 = 64 bytes a token; weights / 4 rounded up
    assert (four.weights, four.kv_cache) == (250_001, 64 * 512 * 32)
    assert four.need == 250_001 + 64 * 512 * 32 + ACTIVATION_MARGIN
    assert four.fits
    # a draft model counts whole on every GPU, whatever the split
    drafted = size(Load(spec, 1_000_001, 2, 512, 32, draft=7_000), "h100", 2, 2, 2, 2)
    assert (drafted.draft, drafted.need) == (7_000, four.need + 7_000)


def test_sizing_of_the_default_model_like_spec_and_refusals():
    spec = ModelSpec.from_config(SMOLLM2)
    weights = spec.num_parameters() * 2   # bf16
    load = Load(spec, weights, 2, context=8192, concurrency=256)
    # 2 x 30 layers x 3 KV heads x 64 x 2 bytes = 23040 bytes a token; x 8192 x 256 = 45 GiB > an L40S's 40.5 usable
    one = size(load, "l40s", 1, 1, 1, 1)
    assert one.kv_cache == 23040 * 8192 * 256 == 45 * 2**30
    assert not one.fits
    # tp 2 does not divide 9 heads (the engines pad nothing), so the next layout is 2 pipeline stages on 2 nodes
    best = smallest(load, "l40s", across_nodes)
    assert (best.gpus_per_node, best.nodes, best.tp, best.pp) == (1, 2, 1, 2)
    assert best.kv_cache == 23040 // 2 * 8192 * 256
    assert best.weights == -(-weights // 2)
    # llama.cpp splits layers over one node's GPUs instead
    assert (lambda s: (s.gpus_per_node, s.nodes, s.tp, s.pp))(smallest(load, "l40s", one_node)) == (2, 1, 1, 2)
    assert (lambda s: (s.gpus_per_node, s.nodes))(choose(load, "h100", across_nodes, None, None)) == (1, 1)
    with pytest.raises(LlmqError, match=r"--gpu l40s --gpus-per-node 1 --nodes 1 does not fit: 47\.\d+ GiB per GPU"
                                        r".*smallest layout that fits is --gpu l40s --gpus-per-node 1 --nodes 2$"):
        choose(load, "l40s", across_nodes, 1, 1)
    with pytest.raises(LlmqError, match="tp 2, pp 1.*does not divide this model's 9 attention heads"):
        choose(load, "h100", across_nodes, 2, 1)
    with pytest.raises(LlmqError, match="no layout fits on H100 80GB GPUs.*lower --max-seq-len"):
        choose(Load(spec, weights, 2, 8192, 10**6), "h100", across_nodes, None, None)
    with pytest.raises(LlmqError, match="no layout with --gpus-per-node 1 fits.*smallest that fits is --gpu l40s "
                                        "--gpus-per-node 2 --nodes 1$"):
        choose(load, "l40s", one_node, 1, None)   # llama.cpp: one node, so more GPUs on it


# --- the stage, on real artifacts of a tiny model -----------------------------------------------------------------

@pytest.fixture(scope="module")
def arts(tmp_path_factory, tiny_model):
    from helpers import make_tiny_model
    from transformers import AutoTokenizer

    from llmq.artifacts import Store
    from llmq.models import resolve_model
    from llmq.pipeline.kvcache import KVOptions, quantize_kv
    from llmq.pipeline.targets import BuildOptions, build_engine

    root = tmp_path_factory.mktemp("deploy")
    store = Store(root / "store")
    model = resolve_model(str(tiny_model()), store)
    # dense weights with calibrated FP8 KV-cache scales: a quantized artifact (no weight quantization, which would
    # build the runtime's C++ kernels; the engines read either through the same quantization_config)
    fp8kv = quantize_kv(model, store, KVOptions(kv="fp8", granularity="tensor", num_samples=2, seq_len=32,
                                                probe_tokens=64, name="tiny-kvfp8"), show_progress=False)
    gguf = build_engine(model, store, BuildOptions(target="gguf"))
    trt = build_engine(fp8kv, store, BuildOptions(target="trtllm"))
    # a draft model: one layer, the target's tokenizer; and one whose tokenizer has a token more
    draft = resolve_model(str(tiny_model(seed=1, name="draft", num_hidden_layers=1)), store)
    other = make_tiny_model(root / "other", seed=2, num_hidden_layers=1)
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(other)
    return store, {"model": model, "fp8kv": fp8kv, "gguf": gguf, "trt": trt, "draft": draft,
                   "draft_gguf": build_engine(draft, store, BuildOptions(target="gguf")),
                   "other": resolve_model(str(other), store)}


def _deployed(arts, src: str, **kw) -> tuple[dict, str]:
    store, a = arts
    art = deploy(a[src], store, DeployOptions(**kw))
    return json.loads(art.file("deploy.json").read_text()), art.file("README.md").read_text()


def _flags(run: str) -> set[str]:
    """The flags of the engine's own program in a command line (not mpirun's, nor python's -m)."""
    for program in ("trtllm-llmapi-launch", "sglang.launch_server"):
        run = run.split(program)[-1]
    return {w for w in shlex.split(run) if w.startswith("-")}


def test_vllm_one_node_and_several(arts):
    rec, _ = _deployed(arts, "model", engine="vllm")
    assert [s["run"] for s in rec["steps"]] == [
        "vllm serve \"$MODEL_DIR\" --served-model-name tiny --tensor-parallel-size 1 --max-model-len 512 "
        "--max-num-seqs 32 --gpu-memory-utilization 0.9 --host 0.0.0.0 --port 8000"]
    assert rec["sizing"]["gpus_per_node"] == 1
    assert rec["kv_cache_dtype"] == "auto"
    rec, readme = _deployed(arts, "fp8kv", engine="vllm", gpus_per_node=2, nodes=2)
    head, workers, serve = rec["steps"]
    assert (head["run"], workers) == ("ray start --head --port 6379", {
        "where": "node 1", "run": 'ray start --address "$HEAD_IP":6379 --block'})
    assert "--tensor-parallel-size 2 --pipeline-parallel-size 2 " in serve["run"]
    assert "--kv-cache-dtype fp8 --distributed-executor-backend ray " in serve["run"]
    assert (rec["sizing"]["tp"], rec["sizing"]["pp"]) == (2, 2)
    assert "Set `HEAD_IP` to node 0's address." in readme
    with pytest.raises(LlmqError, match=r"^--gpus-per-node 2 --nodes 3 \(tp 2, pp 3\): 3 pipeline stages exceed the "
                                        "model's 2 layers$"):
        _deployed(arts, "fp8kv", engine="vllm", gpus_per_node=2, nodes=3)


def test_sglang_one_node_and_several(arts):
    rec, _ = _deployed(arts, "model", engine="sglang", gpus_per_node=2, nodes=1)
    (only,) = rec["steps"]
    assert only["run"].startswith('python -m sglang.launch_server --model-path "$MODEL_DIR" --served-model-name tiny '
                                  "--tp-size 2 --context-length 512")
    assert "--nnodes" not in only["run"]
    assert "--kv-cache-dtype" not in only["run"]   # no calibrated FP8 scales in a dense model
    rec, _ = _deployed(arts, "fp8kv", engine="sglang", gpus_per_node=2, nodes=2, max_seq_len=256,
                       max_concurrency=8)
    assert [s["where"] for s in rec["steps"]] == ["node 0", "node 1"]
    for r, s in enumerate(rec["steps"]):
        assert (f"--tp-size 2 --pp-size 2 --nnodes 2 --node-rank {r} --dist-init-addr \"$HEAD_IP\":5000 "
                "--context-length 256 --max-running-requests 8 --mem-fraction-static 0.9 --kv-cache-dtype fp8_e4m3"
                in s["run"])


def test_trtllm_one_node_and_several(arts):
    store, a = arts
    rec, _ = _deployed(arts, "model", engine="trtllm")
    assert rec["steps"][0]["run"] == (
        'trtllm-serve "$MODEL_DIR" --backend pytorch --tp_size 1 --pp_size 1 --max_batch_size 32 --max_seq_len 512 '
        "--kv_cache_free_gpu_memory_fraction 0.9 --host 0.0.0.0 --port 8000")
    assert rec["files"] == []
    art = deploy(a["trt"], store, DeployOptions(engine="trtllm", gpus_per_node=2, nodes=2))
    rec = json.loads(art.file("deploy.json").read_text())
    (step,) = rec["steps"]
    assert step["run"].startswith('mpirun -H "$NODE0":2,"$NODE1":2 -n 4 trtllm-llmapi-launch trtllm-serve '
                                  '"$MODEL_DIR"/trtllm --backend pytorch --tp_size 2 --pp_size 2')
    assert '--extra_llm_api_options "$DEPLOY_DIR"/trtllm-llm-api-options.yaml' in step["run"]
    assert art.file("trtllm-llm-api-options.yaml").read_text() == "kv_cache_config:\n  dtype: fp8\n"


def test_llama_server_one_node(arts):
    rec, _ = _deployed(arts, "gguf", engine="llama.cpp", max_concurrency=4, threads=8)
    gguf = arts[1]["gguf"]
    (step,) = rec["steps"]
    # llama-server's -c is the context of all slots together: 512 tokens x 4 slots
    assert step["run"] == (f'llama-server -m "$MODEL_DIR"/{rec["model"]} -c 2048 -np 4 -t 8 -ngl 999 --host 0.0.0.0 '
                           "--port 8080")
    assert rec["model"].endswith(".gguf")
    assert rec["sizing"]["weights"] == (gguf.path / rec["model"]).stat().st_size
    rec, _ = _deployed(arts, "gguf", engine="llama.cpp", gpus_per_node=2, nodes=1)
    assert "--split-mode layer" in rec["steps"][0]["run"]
    assert (rec["sizing"]["tp"], rec["sizing"]["pp"]) == (1, 2)
    with pytest.raises(LlmqError, match="^--gpus-per-node 1 --nodes 2: this engine runs on one node here$"):
        _deployed(arts, "gguf", engine="llama.cpp", gpus_per_node=1, nodes=2)


@pytest.mark.parametrize("engine,src,message", [
    ("vllm", "gguf", r"is a gguf engine; vLLM loads a model or quantized artifact .*: deploy tiny, the artifact"),
    ("sglang", "trt", r"is a trtllm engine; SGLang loads a model or quantized artifact"),
    ("trtllm", "fp8kv", r"is a quantized artifact; trtllm-serve .*run `llmq build tiny-kvfp8 --target trtllm`"),
    ("trtllm", "gguf", r"is a gguf engine; .*run `llmq build tiny --target trtllm`"),
    ("llama.cpp", "model", r"is a model artifact; llama-server loads a GGUF file: run `llmq build tiny --target gguf`"),
    ("llama.cpp", "trt", r"is a trtllm engine; .*run `llmq build tiny\S* --target gguf`"),
])
def test_refuses_what_the_engine_cannot_load(arts, engine, src, message):
    with pytest.raises(LlmqError, match=message):
        _deployed(arts, src, engine=engine)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_five_bit_weights_are_refused_for_the_engines_that_run_four_and_eight(arts, engine):
    from llmq.pipeline.quantize import QuantizeOptions, quantize

    store, a = arts
    int5 = quantize(a["model"], QuantizeOptions(bits=5, group_size=32, probe_tokens=0), store, progress=False)
    with pytest.raises(LlmqError, match=r"has 5-bit integer weights, which vLLM and SGLang do not run .*--target gguf"):
        deploy(int5, store, DeployOptions(engine=engine))


def test_every_flag_is_one_the_engine_parses(arts):
    """The flags each engine's commands use, on one node and several, with and without speculative decoding, are
    those found in its own argument parser."""
    cases = {"vllm": "fp8kv", "sglang": "fp8kv", "trtllm": "trt", "llama.cpp": "gguf"}
    drafts = {"vllm": "draft", "sglang": "draft", "trtllm": "draft", "llama.cpp": "draft_gguf"}
    for engine, src in cases.items():
        used = set()
        for g, n in ((1, 1), (2, 1)) if engine == "llama.cpp" else ((1, 1), (2, 2)):
            for spec in (None, "ngram", arts[1][drafts[engine]].ref):
                rec, _ = _deployed(arts, src, engine=engine, gpus_per_node=g, nodes=n, threads=4, speculative=spec)
                for step in rec["steps"]:
                    run = step["run"]
                    if not run.startswith(("ray ", "envsubst ")):   # Ray's own CLI, not the engine's
                        used |= _flags(run)
        assert used == set(FLAGS[engine]["flags"]), engine


# --- speculative decoding: each engine's own configuration, only where asked for -----------------------------------

def _spec_of(run: str, flag: str):
    words = shlex.split(run)
    return words[words.index(flag) + 1]


def test_speculative_ngram_in_each_engines_own_terms(arts):
    """--speculative ngram: each engine's prompt lookup with K draft tokens (llmq's n-gram lengths where the engine
    takes them); nothing to copy, nothing more to size."""
    vllm_spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    rec, readme, (svc,), ray = _vllm_files(arts, "model", speculative="ngram", num_speculative_tokens=3)
    (serve,) = rec["steps"]
    assert json.loads(_spec_of(serve["run"], "--speculative-config")) == vllm_spec
    assert ray["applications"][0]["args"]["llm_configs"][0]["engine_kwargs"]["speculative_config"] == vllm_spec
    assert svc["spec"]["template"]["containers"][0]["command"][-1] == serve["run"].replace('"$MODEL_DIR"',
                                                                                           "/mnt/models")
    assert rec["sizing"]["draft"] == 0
    assert rec["speculative"] == {"method": "ngram", "num_speculative_tokens": 3, "draft": None}
    assert "DRAFT_DIR" not in readme
    assert "- Speculative decoding: prompt lookup (ngram), 3 draft tokens" in readme
    rec, _ = _deployed(arts, "model", engine="sglang", speculative="ngram", num_speculative_tokens=3)
    assert "--speculative-algorithm NGRAM --speculative-num-draft-tokens 4 --host" in rec["steps"][0]["run"]
    store, a = arts
    art = deploy(a["model"], store, DeployOptions(engine="trtllm", speculative="ngram", num_speculative_tokens=3))
    (step,) = json.loads(art.file("deploy.json").read_text())["steps"]
    assert '--extra_llm_api_options "$DEPLOY_DIR"/trtllm-llm-api-options.yaml' in step["run"]
    assert yaml.safe_load(art.file("trtllm-llm-api-options.yaml").read_text()) == {"speculative_config": {
        "decoding_type": "NGram", "max_draft_len": 3, "max_matching_ngram_size": 4}}
    rec, _ = _deployed(arts, "gguf", engine="llama.cpp", speculative="ngram", num_speculative_tokens=3)
    assert "-ngl 999 --spec-type ngram-simple --spec-ngram-simple-size-m 3 --host" in rec["steps"][0]["run"]


# the draft: 1 layer of hidden 64 (4 heads of 16, 2 KV heads), vocabulary 320, untied: embeddings and lm_head 2 x
# 320 x 64, q and o 64 x 64, k and v 64 x 32, gate / up / down 3 x 64 x 128, two norms of 64 and the final one
DRAFT_PARAMS = 2 * 320 * 64 + 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 3 * 64
DRAFT_KV = 2 * 1 * 2 * 16 * 2 * 512 * 32   # K and V x 1 layer x 2 KV heads x 16 x 2 bytes, 512 tokens x 32 sequences


def test_speculative_draft_model_in_each_engines_own_terms(arts):
    """--speculative REF: the draft under $DRAFT_DIR in each engine's terms, the README telling where to copy it, the
    draft a parent of the deploy, and its weights as stored (float32 here) plus its KV cache counted whole on every
    GPU."""
    store, a = arts
    ref = a["draft"].ref
    rec, readme, docs, ray = _vllm_files(arts, "model", speculative=ref, num_speculative_tokens=3, gpus_per_node=2,
                                         nodes=1)
    vllm_spec = {"method": "draft_model", "model": "$DRAFT_DIR", "num_speculative_tokens": 3}
    (serve,) = rec["steps"]
    assert json.loads(_spec_of(serve["run"], "--speculative-config")) == vllm_spec
    assert '--speculative-config \'{"method": "draft_model", "model": "\'"$DRAFT_DIR"\'", ' in serve["run"]
    assert ray["applications"][0]["args"]["llm_configs"][0]["engine_kwargs"]["speculative_config"] == vllm_spec
    assert docs is None
    assert rec["files"] == [RAY_FILE]
    assert [s["run"] for s in rec["instead"]] == [
        "envsubst '$MODEL_DIR $DRAFT_DIR' < \"$DEPLOY_DIR\"/ray-serve-llm.yaml > serve.yaml && serve run serve.yaml"]
    assert any(n.startswith("no KServe manifest with a draft model") for n in rec["notes"])
    s = rec["sizing"]
    assert s["draft"] == DRAFT_PARAMS * 4 + DRAFT_KV
    assert s["need"] == (s["weights"] + s["kv_cache"] + s["draft"] + ACTIVATION_MARGIN)
    assert rec["speculative"]["draft"]["id"] == a["draft"].id
    assert (f"Copy the draft model's artifact {ref} (its directory, {a['draft'].path}) there too and set `DRAFT_DIR` "
            "to it.") in readme
    assert "| draft |" in readme
    art = deploy(a["model"], store, DeployOptions(engine="sglang", speculative=ref, num_speculative_tokens=3))
    assert art.parents == [a["model"].id, a["draft"].id]
    rec = json.loads(art.file("deploy.json").read_text())
    assert ('--speculative-algorithm STANDALONE --speculative-draft-model-path "$DRAFT_DIR" --speculative-num-steps 3 '
            "--speculative-eagle-topk 1 --speculative-num-draft-tokens 4 --host") in rec["steps"][0]["run"]
    art = deploy(a["model"], store, DeployOptions(engine="trtllm", speculative=ref, num_speculative_tokens=3))
    expand, serve = json.loads(art.file("deploy.json").read_text())["steps"]
    assert (expand["where"], expand["run"]) == (
        "every node", "envsubst '$DRAFT_DIR' < \"$DEPLOY_DIR\"/trtllm-llm-api-options.yaml > "
        "/tmp/trtllm-llm-api-options.yaml")
    assert "--extra_llm_api_options /tmp/trtllm-llm-api-options.yaml" in serve["run"]
    assert yaml.safe_load(art.file("trtllm-llm-api-options.yaml").read_text()) == {"speculative_config": {
        "decoding_type": "Draft_Target", "max_draft_len": 3, "speculative_model": "$DRAFT_DIR"}}
    rec, _ = _deployed(arts, "gguf", engine="llama.cpp", speculative=a["draft_gguf"].ref, num_speculative_tokens=3)
    gguf = rec["speculative"]["draft"]["model"]
    assert (f'--spec-type draft-simple -md "$DRAFT_DIR"/{gguf} --spec-draft-n-max 3 -ngld 999 --host'
            in rec["steps"][0]["run"])
    assert gguf.endswith(".gguf")
    assert rec["sizing"]["draft"] == (a["draft_gguf"].path / gguf).stat().st_size + DRAFT_KV


def test_speculative_values_and_keys_are_the_engines_own(arts):
    """Every speculative value and config key emitted, for ngram and a draft, is one tests/data lists as read in the
    engine's source."""
    store, a = arts
    for spec in ("ngram", a["draft"].ref):
        rec, _ = _deployed(arts, "model", engine="vllm", speculative=spec)
        config = json.loads(_spec_of(rec["steps"][0]["run"], "--speculative-config"))
        v = FLAGS["vllm"]["speculative_config"]
        assert set(config) <= set(v["keys"])
        assert config["method"] in v["method"]
        rec, _ = _deployed(arts, "model", engine="sglang", speculative=spec)
        assert _spec_of(rec["steps"][0]["run"], "--speculative-algorithm") in FLAGS["sglang"]["speculative_algorithm"][
            "values"]
        art = deploy(a["model"], store, DeployOptions(engine="trtllm", speculative=spec))
        config = yaml.safe_load(art.file("trtllm-llm-api-options.yaml").read_text())["speculative_config"]
        t = FLAGS["trtllm"]["speculative_config"]
        assert set(config) <= set(t["keys"])
        assert config["decoding_type"] in t["decoding_type"]
    for spec in ("ngram", a["draft_gguf"].ref):
        rec, _ = _deployed(arts, "gguf", engine="llama.cpp", speculative=spec)
        assert _spec_of(rec["steps"][0]["run"], "--spec-type") in FLAGS["llama.cpp"]["spec_type"]["values"]


def test_speculative_refusals(arts, tmp_path):
    from helpers import make_tiny_model

    from llmq.models import resolve_model

    store, a = arts
    with pytest.raises(LlmqError, match=r"^--speculative draft: \S+ is a model artifact; llama-server loads a GGUF "
                                        r"file: run `llmq build draft --target gguf`$"):
        _deployed(arts, "gguf", engine="llama.cpp", speculative="draft")
    with pytest.raises(LlmqError, match=r"^--speculative \S+: \S+ is a gguf engine; vLLM loads a model or quantized"):
        _deployed(arts, "model", engine="vllm", speculative=a["draft_gguf"].ref)
    with pytest.raises(LlmqError, match=r"^--speculative other: \S+ has a different tokenizer than \S+; a draft "
                                        "model must share the target's$"):
        _deployed(arts, "model", engine="sglang", speculative="other")
    short = resolve_model(str(make_tiny_model(tmp_path / "short", seed=3, num_hidden_layers=1,
                                              max_position_embeddings=256)), store)
    with pytest.raises(LlmqError, match=r"^--speculative short: \S+ has 256 positions, fewer than the 512 tokens a "
                                        "sequence is sized for; lower --max-seq-len$"):
        _deployed(arts, "model", engine="vllm", speculative="short")
    assert _deployed(arts, "model", engine="vllm", speculative=short.ref, max_seq_len=256)[0]["speculative"]["draft"]
    deploy(a["model"], store, DeployOptions(engine="sglang", name="a-deploy"))
    with pytest.raises(LlmqError, match="^--speculative a-deploy is a deploy artifact; a draft model is a model"):
        _deployed(arts, "model", engine="sglang", speculative="a-deploy")


def test_nothing_speculative_unless_asked(arts):
    """Without --speculative: no speculative flag, key or file, no draft in the sizing."""
    store, a = arts
    for engine, src in (("vllm", "model"), ("sglang", "model"), ("trtllm", "model"), ("llama.cpp", "gguf")):
        art = deploy(a[src], store, DeployOptions(engine=engine, num_speculative_tokens=7))
        rec = json.loads(art.file("deploy.json").read_text())
        text = " ".join(art.file(f).read_text() for f in rec["files"]) + " ".join(s["run"] for s in rec["steps"])
        assert "specul" not in text, engine
        assert "--spec-" not in text, engine
        assert "DRAFT" not in text, engine
        assert " 7" not in text, engine
        assert rec["sizing"]["draft"] == 0
        assert rec["speculative"] is None
        assert art.parents == [a[src].id]
        assert "- Speculative decoding: off" in art.file("README.md").read_text()


def _vllm_files(arts, src: str, **kw) -> tuple[dict, str, list[dict] | None, dict]:
    store, a = arts
    art = deploy(a[src], store, DeployOptions(engine="vllm", **kw))
    kserve = KSERVE_FILE in art.manifest["files"]
    return (json.loads(art.file("deploy.json").read_text()), art.file("README.md").read_text(),
            list(yaml.safe_load_all(art.file(KSERVE_FILE).read_text())) if kserve else None,
            yaml.safe_load(art.file(RAY_FILE).read_text()))


def test_kserve_and_ray_serve_carry_the_launch_commands_layout(arts):
    rec, readme, docs, ray = _vllm_files(arts, "fp8kv", gpus_per_node=2, nodes=2)
    serve = rec["steps"][-1]["run"]
    preset, svc = docs
    assert preset["kind"] == "LLMInferenceServiceConfig"
    # the name KServe looks up, which it does not ship
    assert preset["metadata"]["name"] == "kserve-config-llm-worker-pipeline-parallel"
    spec = svc["spec"]
    assert (svc["kind"], svc["metadata"]["name"], spec["model"], spec["parallelism"]) == (
        "LLMInferenceService", "tiny-kvfp8", {"uri": "$MODEL_URI", "name": "tiny-kvfp8"}, {"tensor": 2, "pipeline": 2})
    (leader,), (worker,) = spec["template"]["containers"], spec["worker"]["containers"]
    # one pod a node, each holding that node's tp GPUs; the leader runs the very `vllm serve` of the steps
    assert leader["resources"] == worker["resources"] == {"limits": {"nvidia.com/gpu": 2},
                                                          "requests": {"nvidia.com/gpu": 2}}
    assert leader["command"] == ["/bin/bash", "-c", "ray start --head --port 6379 && "
                                 + serve.replace('"$MODEL_DIR"', "/mnt/models")]
    assert worker["command"][-1] == 'ray start --address "$LWS_LEADER_ADDRESS":6379 --block'
    (app,) = ray["applications"]
    (llm,) = app["args"]["llm_configs"]
    assert llm["engine_kwargs"] == {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "max_model_len": 512,
                                    "max_num_seqs": 32, "gpu_memory_utilization": 0.9, "kv_cache_dtype": "fp8"}
    assert all(f"--{k.replace('_', '-')} {v} " in serve for k, v in llm["engine_kwargs"].items())
    assert (llm["model_loading_config"], llm["accelerator_type"], llm["placement_group_config"]) == (
        {"model_id": "tiny-kvfp8", "model_source": "$MODEL_DIR"}, "H100",
        {"bundle_per_worker": {"GPU": 1}, "strategy": "PACK"})
    assert [s["run"] for s in rec["instead"]] == [
        "envsubst '$MODEL_URI' < \"$DEPLOY_DIR\"/kserve-llminferenceservice.yaml | kubectl apply -f -",
        "envsubst '$MODEL_DIR' < \"$DEPLOY_DIR\"/ray-serve-llm.yaml > serve.yaml && serve run serve.yaml"]
    assert "Or, instead, with a cluster manager" in readme
    assert "| kubectl apply -f -\n" in readme
    # one node: no worker, no pipeline stages, a dense KV cache, Ray's A100 label, every bundle on the node
    rec, readme, docs, ray = _vllm_files(arts, "model", gpu="a100-80gb", gpus_per_node=1, nodes=1)
    ((svc,), (llm,)) = docs, ray["applications"][0]["args"]["llm_configs"]
    assert "worker" not in svc["spec"]
    assert svc["spec"]["parallelism"] == {"tensor": 1}
    assert svc["spec"]["template"]["containers"][0]["command"][-1] == rec["steps"][0]["run"].replace(
        '"$MODEL_DIR"', "/mnt/models")
    assert "kv_cache_dtype" not in llm["engine_kwargs"]
    assert "pipeline_parallel_size" not in llm["engine_kwargs"]
    assert (llm["accelerator_type"], llm["placement_group_config"]["strategy"]) == ("A100", "STRICT_PACK")
    rec, readme = _deployed(arts, "model", engine="sglang")
    assert rec["files"] == rec["instead"] == []
    assert "written for `--engine vllm` only" in readme


def _leaves(node, path=()):
    """(path, value) of each leaf of a YAML document; a list's items add `[]` to its field's name."""
    if isinstance(node, dict) and node:
        for k, v in node.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(node, list):
        for v in node:
            yield from _leaves(v, (*path[:-1], path[-1] + "[]"))
    else:
        yield path, node


def _schema_type(allowed: dict, path: tuple) -> str | None:
    """The type the schema gives `path` (`*` in a listed path: any key of a map), None where it has no such field."""
    for listed, kind in allowed.items():
        parts = listed.split(".")
        if len(parts) == len(path) and all(p in ("*", q) for p, q in zip(parts, path)):
            return kind
    return None


TYPES = {"string": {str}, "integer": {int}, "object": {dict}, "int-or-string": {int, str}}


def test_kserve_and_ray_serve_files_use_only_fields_their_schemas_define(arts):
    """Each path of the KServe manifest is one the LLMInferenceService CRD's v1alpha1 schema defines, with a value
    of its type; each key of the Ray Serve config a field of Ray's models; engine_kwargs are vLLM flags."""
    r = SCHEMAS["ray"]
    for g, n in ((1, 1), (2, 2)):
        _, _, docs, ray = _vllm_files(arts, "fp8kv", gpus_per_node=g, nodes=n)
        for doc in docs:
            allowed = SCHEMAS["kserve"][doc["kind"]]
            for path, value in _leaves(doc):
                kind = _schema_type(allowed, path)
                assert kind, (doc["kind"], ".".join(path), value)
                assert type(value) in TYPES[kind], (doc["kind"], ".".join(path), value)
        assert set(ray) <= set(r["ServeDeploySchema"])
        (app,) = ray["applications"]
        assert set(app) <= set(r["ServeApplicationSchema"])
        assert app["import_path"] == r["import_path"]
        assert set(app["args"]) <= set(r["LLMServingArgs"])
        (llm,) = app["args"]["llm_configs"]
        assert set(llm) <= set(r["LLMConfig"])
        assert set(llm["model_loading_config"]) <= set(r["ModelLoadingConfig"])
        assert set(llm["deployment_config"]) <= set(r["DeploymentConfig"])
        assert set(llm["placement_group_config"]) <= set(r["placement_group_config"])
        assert llm["placement_group_config"]["strategy"] in r["placement_strategy"]
        assert {f"--{k.replace('_', '-')}" for k in llm["engine_kwargs"]} <= set(FLAGS["vllm"]["flags"])
    assert {gpu.ray for gpu in GPUS.values()} <= set(r["accelerator_type"])


def test_written_through_the_store_and_nothing_left_on_failure(arts, monkeypatch):
    from click.testing import CliRunner

    from llmq.cli.main import cli

    store, a = arts
    art = deploy(a["fp8kv"], store, DeployOptions(engine="vllm", name="dep"))
    assert art.kind == "deploy"
    assert art.parents == [a["fp8kv"].id]
    assert set(art.manifest["files"]) == {"README.md", "deploy.json", KSERVE_FILE, RAY_FILE}
    art.verify(full=True)
    assert store.resolve("dep").id == art.id
    before = sorted(p.name for p in store.root.iterdir())
    with pytest.raises(LlmqError, match="does not fit"):
        deploy(a["model"], store, DeployOptions(engine="vllm", name="nofit", gpus_per_node=1, nodes=1,
                                                max_concurrency=10**7))
    assert sorted(p.name for p in store.root.iterdir()) == before
    assert store.versions("nofit") == []

    def broken(*_):
        raise OSError("disk gone")

    monkeypatch.setattr("llmq.pipeline.deploy.stage.readme", broken)   # a failure while the files are written
    with pytest.raises(OSError, match="disk gone"):
        deploy(a["model"], store, DeployOptions(engine="vllm", name="halfway"))
    assert sorted(p.name for p in store.root.iterdir()) == before
    monkeypatch.undo()
    run = CliRunner().invoke(cli, ["--store", str(store.root), "deploy", a["model"].ref, "--engine", "sglang",
                                   "--gpus-per-node", "1", "--nodes", "1", "--max-concurrency", "10000000"])
    assert run.exit_code == 2
    assert run.output.count("\n") == 1
    assert run.output.startswith("error: --gpu h100 ")
    run = CliRunner().invoke(cli, ["--store", str(store.root), "deploy", a["model"].ref, "--engine", "sglang",
                                   "--max-model-len", "256"])   # vLLM's spelling of --max-seq-len
    assert run.exit_code == 0, run.output
    assert "| H100 80GB | 1 x 1 | 1 x 1 |" in run.output
    assert "on the node: python -m sglang.launch_server" in run.output
    assert "--context-length 256 " in run.output
    with pytest.raises(LlmqError, match="^--max-seq-len 513 exceeds the model's 512 positions$"):
        deploy(a["model"], store, DeployOptions(engine="vllm", max_seq_len=513))


# --- hostile names: every word quoted for the shell, names outside a safe set refused ----------------------------

# each would run `touch` (or split into several arguments) if it reached a shell unquoted
HOSTILE = ["x$(touch PWNED)`touch PWNED2`;touch PWNED3 hi.gguf", "a'b\"c\\d $HOME *?.gguf",
           "new\nline;touch PWNED.gguf"]
PROGRAMS = ("vllm", "ray", "python", "trtllm-serve", "mpirun", "trtllm-llmapi-launch", "llama-server", "envsubst",
            "kubectl", "serve")
ENV = {"MODEL_DIR": "/models/a b", "DRAFT_DIR": "/drafts/c d", "HEAD_IP": "10.0.0.1", "NODE0": "n0", "NODE1": "n1",
       "LWS_LEADER_ADDRESS": "10.0.0.2"}


def _resealed(store, art, old: str, new: str, key: tuple[str, ...]):
    """A copy of engine artifact `art` whose output `old` is renamed `new` (engine.json's outputs[key...] too), its
    manifest resealed with llmq's own hash functions, as anyone with write access to a shared store can."""
    import shutil

    from llmq.artifacts import hashing
    from llmq.artifacts import manifest as mf

    d = store.root / f"{art.name}-renamed" / "v1"
    shutil.copytree(art.path, d)
    (d / old).rename(d / new)
    spec = json.loads((d / "engine.json").read_text())
    (*path, last), node = key, spec["outputs"]
    for k in path:
        node = node[k]
    node[last] = new
    (d / "engine.json").write_text(json.dumps(spec))
    files = hashing.hash_payload(d)
    m = {k: v for k, v in art.manifest.items() if k != "digest"} | {
        "name": d.parent.name, "version": 1, "files": files, "id": hashing.content_id(files)}
    m["digest"] = mf.digest(m)
    mf.write(d / hashing.MANIFEST_NAME, m)
    return store.resolve(f"{d.parent.name}/v1")


@pytest.mark.parametrize("engine,src,key", [("llama.cpp", "gguf", ("gguf", "file")),
                                            ("trtllm", "trt", ("hf_checkpoint",))])
def test_a_file_name_outside_the_safe_set_is_refused_in_one_line(arts, tmp_path, monkeypatch, engine, src, key):
    from click.testing import CliRunner

    from llmq.cli.main import cli

    store, a = arts
    spec = json.loads(a[src].file("engine.json").read_text())["outputs"]
    old = spec[key[0]][key[1]] if len(key) == 2 else spec[key[0]]
    bad = _resealed(store, a[src], old, HOSTILE[0], key)
    monkeypatch.chdir(tmp_path)
    before = {x.path for x in store.list()}
    run = CliRunner().invoke(cli, ["--store", str(store.root), "deploy", bad.ref, "--engine", engine])
    assert run.exit_code == 2, run.output
    assert run.output.count("\n") == 1, run.output
    assert run.output.startswith(f"error: {bad.ref} names the file ")
    assert "outside the safe set" in run.output
    assert {x.path for x in store.list()} == before
    assert list(tmp_path.iterdir()) == []


def _launches(arts, name: str):
    """(engine, command line) of every command each engine's launch holds, on one node and several, with and without
    speculative decoding, for a model (and draft) under the file name `name`; KServe's pod commands too."""
    from llmq.pipeline.deploy.engines import Loadable, Speculation

    store, a = arts
    spec = ModelSpec.from_config(TINY)
    m = Loadable(name, spec, 10**6, kv_fp8=True)
    draft = Speculation(3, Loadable("draft-" + name, spec, 10**5, kv_fp8=False))
    for engine in ENGINES.values():
        for g, n in ((1, 1), (2, 1)) if engine.name == "llama.cpp" else ((1, 1), (2, 2)):
            tp, pp = engine.to_ranks(g, n)
            sizing = size(Load(spec, 10**6, 1, 512, 8), "h100", g, n, tp, pp)
            for sp in (None, Speculation(3), draft):
                launch = engine.launch(m, sizing, {"served_name": "tiny", "max_seq_len": 512, "max_concurrency": 8,
                                                   "threads": 4, "speculation": sp})
                for step in (*launch.steps, *launch.instead):
                    yield engine.name, step.run
                if KSERVE_FILE in launch.files:
                    for doc in yaml.safe_load_all(launch.files[KSERVE_FILE]):
                        for pod in ("template", "worker"):
                            if pod in doc["spec"]:
                                yield engine.name, doc["spec"][pod]["containers"][0]["command"][-1]


@pytest.mark.parametrize("name", HOSTILE, ids=["subst", "quotes", "newline"])
def test_every_command_line_is_quoted_for_the_shell(arts, tmp_path, name):
    """Each command of each engine parses (`bash -n`) and, run by bash with fake programs on PATH, hands the
    program the model's and the draft's paths as one argument each (or inside one JSON argument), with $MODEL_DIR
    (holding a space) expanded and nothing else: no file is made."""
    import subprocess

    bin_dir, log, work, deploy_dir = (tmp_path / d for d in ("bin", "log", "work", "deploy"))
    for d in (bin_dir, log, work, deploy_dir):
        d.mkdir()
    for p in PROGRAMS:
        (bin_dir / p).write_text('#!/bin/bash\nprintf \'%s\\0\' "${0##*/}" "$@" > "$(mktemp "$FAKE_LOG/XXXXXX")"\n')
        (bin_dir / p).chmod(0o755)
    for f in (KSERVE_FILE, RAY_FILE, "trtllm-llm-api-options.yaml"):
        (deploy_dir / f).write_text("")
    env = {**ENV, "PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_LOG": str(log), "DEPLOY_DIR": str(deploy_dir),
           "HOME": str(tmp_path)}
    paths = {f"{d}/{n}" for d in (ENV["MODEL_DIR"], "/mnt/models") for n in (name,)} | {
        f"{ENV['DRAFT_DIR']}/draft-{name}"}
    seen = set()
    for engine, run in _launches(arts, name):
        check = subprocess.run(["bash", "-n", "-c", run], capture_output=True, text=True)
        assert check.returncode == 0, (engine, run, check.stderr)
        if "/tmp/" in run:   # trtllm's copy of its options file to /tmp: parsed above, not run here
            continue
        for f in log.iterdir():
            f.unlink()
        done = subprocess.run(["bash", "-c", run], cwd=work, env=env, capture_output=True, text=True)
        assert done.returncode == 0, (engine, run, done.stderr)
        assert not {p.name for p in work.iterdir()} - {"serve.yaml"}, (engine, run)
        assert not list(tmp_path.glob("PWNED*")), (engine, run)
        assert not list(Path.cwd().glob("PWNED*")), (engine, run)
        calls = [f.read_bytes().decode().split("\0")[:-1] for f in log.iterdir()]
        assert calls, (engine, run)
        for argv in calls:
            for arg in argv[1:]:
                named = {arg} | ({str(v) for v in json.loads(arg).values()} if arg.startswith("{") else set())
                seen |= named & paths
                assert not any(p in arg for p in paths) or named & paths, (engine, run, arg)
    assert seen == paths
