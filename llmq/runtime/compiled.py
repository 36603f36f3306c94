"""The compiled decode step (`EngineConfig.compile`, `llmq serve --compile`): torch.compile (inductor) of the model's
forward for steps that hold only decodes, the eager forward staying the reference for everything else.

A decode step of a small model is hundreds of tiny operations (norms, rotary, residual adds, dtype casts around the
quantized kernels, the KV-cache write); eagerly each pays the dispatcher and the interpreter, which on a CPU costs
more than the arithmetic. Inductor fuses the element-wise work into a few generated kernels and calls the same
matmul and attention kernels the eager path calls. Shapes are dynamic (batch size, context blocks), so one graph
serves every decode batch; inductor specialises sizes 0 and 1, so batch 1 and short contexts get graphs of their
own the first time they are seen. Compiling takes tens of seconds on a CPU (cached on disk by inductor afterwards),
so it is opt-in. Prefill chunks, scoring and every step with a prefill run eagerly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import LlmqError


def compiler_available(device: torch.device) -> str | None:
    """None when inductor can build code for `device` here, else why not (one line)."""
    if device.type == "cpu":
        from torch._inductor import cpp_builder, exc

        try:
            cpp_builder.get_cpp_compiler()  # $CXX or inductor's search; raises when none works
        except exc.InvalidCxxCompiler:
            return "--compile needs a C++ compiler for inductor's CPU kernels and none works here; install g++ " \
                   "(or point CXX at one) or drop --compile"
        return None
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "--compile needs triton for inductor's CUDA kernels; pip install triton or drop --compile"
        return None
    return f"--compile is not supported on {device.type}"


def compile_decode(model: torch.nn.Module, device: torch.device) -> Callable:
    """The model's forward compiled for decode-only steps (same arguments and result as `model(...)`)."""
    why = compiler_available(device)
    if why:
        raise LlmqError(why)
    forward = type(model).forward
    compiled = torch.compile(lambda *args: forward(model, *args), dynamic=True)

    def decode(*args):
        with torch.no_grad():  # not inference_mode: compiled graphs cannot take inference tensors as inputs
            return compiled(*args)

    return decode
