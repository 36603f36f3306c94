"""The bundled continuous-batching runtime that `serve`, `eval` and `bench --offline` share.

Its names are imported on first use, so that the command line reads the runtime's settings (config.py) without
loading torch."""

import importlib

_MODULE_OF = {"EngineConfig": "config", "EngineStats": "engine", "LLMEngine": "engine", "RequestMetrics": "engine",
              "RequestOutput": "engine", "SamplingParams": "sampling", "ScoreOutput": "scorer",
              "ScoreRequest": "scorer"}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_MODULE_OF[name]}", __name__), name)
