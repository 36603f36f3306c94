import pytest
from helpers import family_config
from helpers import make_tiny_model as _make_tiny_model

from llmq.artifacts import Store


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


@pytest.fixture(scope="session")
def default_model(tmp_path_factory):
    """The embedded default model (SmolLM2-135M-Instruct) imported into a session store; ~30 s the first time."""
    from llmq.models import resolve_model

    return resolve_model(None, Store(tmp_path_factory.mktemp("default-store")))


@pytest.fixture(scope="session")
def default_store(default_model):
    """The session store holding the default model and the quantized artifacts made from it."""
    return Store(default_model.path.parent.parent)


def _default_rtn(default_model, default_store, **kw):
    from llmq.pipeline.quantize import QuantizeOptions, quantize

    return quantize(default_model, QuantizeOptions(method="rtn", **kw), default_store, progress=False)


@pytest.fixture(scope="session")
def default_int4(default_model, default_store):
    """INT4 RTN (groups of 64) of the default model, made once per session and shared by every integration test."""
    return _default_rtn(default_model, default_store, bits=4, group_size=64)


@pytest.fixture(scope="session")
def default_gptq(default_model, default_store):
    """INT4 GPTQ (groups of 64, 16 calibration windows of 128 tokens) of the default model, made once per session:
    test_quantize compares it with RTN, test_export_gguf writes it to GGUF."""
    from llmq.pipeline.quantize import QuantizeOptions, quantize

    return quantize(default_model, QuantizeOptions(bits=4, method="gptq", num_samples=16, seq_len=128), default_store,
                    progress=False)


@pytest.fixture(scope="session")
def default_int8(default_model, default_store):
    """INT8 RTN (per channel) of the default model, made once per session."""
    return _default_rtn(default_model, default_store, bits=8)

