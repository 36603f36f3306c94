import pytest

from llmq.artifacts import Store
from tiny import make_tiny_model as _make_tiny_model


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
def default_model(tmp_path_factory):
    """The embedded default model (SmolLM2-135M-Instruct) imported into a session store; ~30 s the first time."""
    from llmq.models import resolve_model

    return resolve_model(None, Store(tmp_path_factory.mktemp("default-store")))
