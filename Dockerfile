# llmq image. Default: GPU, on NVIDIA's PyTorch container (CUDA, NCCL and a CUDA build of torch included).
#   docker build -t llmq .                                       GPU (needs --gpus all at run time)
#   docker build -t llmq-trtllm --build-arg BASE=nvcr.io/nvidia/tensorrt-llm/release:latest \
#                --build-arg EXTRAS=all,trtllm .                 adds TensorRT-LLM for `llmq build --target trtllm`
#   docker build -t llmq-cpu --build-arg BASE=python:3.11-slim \
#                --build-arg TORCH_SPEC=torch==2.13.0 --build-arg TORCH_INDEX=<PyTorch's CPU wheel index> .
ARG BASE=nvcr.io/nvidia/pytorch:25.10-py3
FROM ${BASE}

ARG TORCH_SPEC=""
ARG TORCH_INDEX=""
ARG EXTRAS=all

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /opt/llmq

# torch first and on its own, so the CPU variant can take it from a CPU-only index; GPU bases already have it.
# The pin is the TORCH_SPEC build argument, which hadolint cannot see.
# hadolint ignore=DL3013
RUN if [ -n "${TORCH_SPEC}" ]; then \
        pip install --no-cache-dir ${TORCH_INDEX:+--index-url "${TORCH_INDEX}"} "${TORCH_SPEC}"; \
    fi

COPY pyproject.toml README.md ./
COPY llmq ./llmq
COPY recipes ./recipes
# The same install as README.md's main-job command.
RUN pip install --no-cache-dir -e ".[${EXTRAS}]"

ENV LLMQ_STORE=/data/store \
    LLMQ_CACHE=/data/cache
VOLUME ["/data"]
EXPOSE 8000
ENTRYPOINT ["llmq"]
CMD ["--help"]
