# syntax=docker/dockerfile:1.7
# scalerl-reward: the reward service alone (a sequence-classification reward model over
# gRPC). The build argument TORCH_VARIANT picks the torch build: cpu, or a CUDA build of
# the PyTorch index such as cu128.
#
#   docker build -f deploy/images/scalerl-reward.Dockerfile -t ghcr.io/scalerl/scalerl-reward:0.1.0 .
ARG PYTHON_IMAGE=docker.io/library/python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VARIANT=cpu
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
RUN /opt/scalerl/bin/pip install --no-cache-dir ".[torch]"

FROM ${PYTHON_IMAGE}
COPY --from=build /opt/scalerl /opt/scalerl
RUN groupadd --gid 10001 scalerl \
    && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin scalerl
ENV PATH=/opt/scalerl/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    HF_HUB_OFFLINE=1
USER 10001:10001
# gRPC RewardService (deploy/components/reward-model/reward.yaml).
EXPOSE 50055
ENTRYPOINT ["scalerl-reward"]
CMD ["--model", "/models/reward", "--host", "0.0.0.0", "--port", "50055"]
