"""Fixtures. The suite runs on pytest-xdist's two workers (pyproject's addopts), a test file to a worker: each worker
computes with one thread (two workers on the two cores, not four threads), the files that take longest start first
(HEAVY: no long file left alone at the end), and the costly session fixtures (the default model and its
quantizations) are made once, by the first worker to ask, in a store the workers share (`_once`)."""

import fcntl
import os

import pytest
from helpers import family_config
from helpers import make_tiny_model as _make_tiny_model

from llmq.artifacts import Store

if os.environ.get("PYTEST_XDIST_WORKER"):  # before torch is imported (nothing above imports it): read once
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# the slowest files (CI's --durations), longest first; the default GPTQ fixture's second user (test_quantize) a few
# files after its first (test_export_gguf), so that it finds the fixture made rather than waits for it
HEAVY = ("test_recipe.py", "test_export_gguf.py", "test_eval.py", "test_gemma3.py", "test_hybrid.py",
         "test_quantize.py", "test_build_default.py", "test_compiled.py", "test_bench.py", "test_server.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(HEAVY)}
    items.sort(key=lambda it: rank.get(it.path.name, len(HEAVY)))  # stable: the rest keep their order


@pytest.fixture
def store(tmp_path):
    return Store(tmp_path / "store")


@pytest.fixture
def make_tiny_model():
    """Factory: make_tiny_model(path, seed=0, **config_overrides) -> `path`, an HF directory of a random tiny model."""
    return _make_tiny_model


@pytest.fixture
def tiny_model_dir(tmp_path):
    return _make_tiny_model(tmp_path / "tiny")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The shared tiny random models: tiny_model(seed=0, name="tiny", bf16=False, **config_overrides) -> an HF
    directory `name` (weights in bf16 with `bf16`), made once a session for each set of arguments. Read them, never
    write into them (a test that edits a model makes its own with make_tiny_model)."""
    made: dict[str, object] = {}

    def get(seed: int = 0, name: str = "tiny", bf16: bool = False, **overrides):
        key = repr((seed, name, bf16, sorted(overrides.items())))   # the name: what `llmq import` calls it
        if key not in made:
            path = _make_tiny_model(tmp_path_factory.mktemp("tiny") / name, seed=seed, **overrides)
            if bf16:   # stored in bf16, as real checkpoints are
                import torch
                from transformers import AutoModelForCausalLM

                AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).save_pretrained(path)
            made[key] = path
        return made[key]

    return get


@pytest.fixture(scope="session")
def family_dir(tiny_model):
    """family_dir(name) -> the tiny model of a family of the architecture registry (helpers.FAMILIES, which
    test_families checks is the registry), one of tiny_model's."""
    return lambda name: tiny_model(seed=4, name=name, **family_config(name))


@pytest.fixture(scope="module")
def quantized(source, request):
    """name -> the artifact `llmq quantize` writes from the module's `source` fixture ((store, model artifact)) with
    the module's QUANTIZE[name] options, on a short calibration; made once per module, on first use."""
    from llmq.pipeline.quantize import QuantizeOptions, quantize

    store, src = source
    table, made = request.module.QUANTIZE, {}

    def get(name):
        if name not in made:
            opts = QuantizeOptions(num_samples=4, seq_len=64, probe_tokens=request.module.PROBE_TOKENS, **table[name])
            made[name] = quantize(src, opts, store, progress=False)
        return made[name]

    return get


def _shared_root(tmp_path_factory):
    """The session's temporary root, one for all xdist workers (each worker's base is a directory inside it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _once(tmp_path_factory, key: str, make) -> str:
    """make() (a path) run once a session across the workers: the first to ask makes it while the others wait on
    its lock, then every worker reads what it wrote."""
    root = _shared_root(tmp_path_factory)
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = root / f"{key}.path"
        if not done.exists():
            done.write_text(str(make()))
        return done.read_text()


@pytest.fixture(scope="session")
def default_store(tmp_path_factory):
    """The session store holding the default model and the quantized artifacts made from it (one for all workers:
    tests add artifacts to it, never assume what else it holds)."""
    return Store(_shared_root(tmp_path_factory) / "default-store")


@pytest.fixture(scope="session")
def default_model(tmp_path_factory, default_store):
    """The embedded default model (SmolLM2-135M-Instruct) imported into the session store; ~30 s the first time."""
    from llmq.models import resolve_model

    return default_store.resolve(_once(tmp_path_factory, "default-model",
                                       lambda: resolve_model(None, default_store).path))


def _default_quantized(tmp_path_factory, default_model, default_store, key: str, **kw):
    from llmq.pipeline.quantize import QuantizeOptions, quantize

    return default_store.resolve(_once(tmp_path_factory, key, lambda: quantize(
        default_model, QuantizeOptions(**kw), default_store, progress=False).path))


@pytest.fixture(scope="session")
def default_int4(tmp_path_factory, default_model, default_store):
    """INT4 RTN (groups of 64) of the default model, made once per session and shared by every integration test."""
    return _default_quantized(tmp_path_factory, default_model, default_store, "default-int4", method="rtn", bits=4,
                              group_size=64)


@pytest.fixture(scope="session")
def default_gptq(tmp_path_factory, default_model, default_store):
    """INT4 GPTQ (groups of 64, 16 calibration windows of 128 tokens) of the default model, made once per session:
    test_quantize compares it with RTN, test_export_gguf writes it to GGUF."""
    return _default_quantized(tmp_path_factory, default_model, default_store, "default-gptq", bits=4, method="gptq",
                              num_samples=16, seq_len=128)


@pytest.fixture(scope="session")
def default_int8(tmp_path_factory, default_model, default_store):
    """INT8 RTN (per channel) of the default model, made once per session."""
    return _default_quantized(tmp_path_factory, default_model, default_store, "default-int8", method="rtn", bits=8)

