# syntax=docker/dockerfile:1.7
# scalerl-curve: the curve service alone. The base install of the package is torch-free
# (pyproject.toml), so this image holds grpcio, numpy and scipy but no torch.
#
#   docker build -f deploy/images/scalerl-curve.Dockerfile -t ghcr.io/scalerl/scalerl-curve:0.1.0 .
ARG PYTHON_IMAGE=docker.io/library/python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY scalerl ./scalerl
COPY scalerl_cli ./scalerl_cli
COPY rollout_service ./rollout_service
COPY learner_service ./learner_service
COPY curve_service ./curve_service
COPY sandbox_service ./sandbox_service
COPY reward_service ./reward_service
RUN python -m venv /opt/scalerl \
    && /opt/scalerl/bin/pip install --no-cache-dir .

FROM ${PYTHON_IMAGE}
COPY --from=build /opt/scalerl /opt/scalerl
RUN groupadd --gid 10001 scalerl \
    && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin scalerl
ENV PATH=/opt/scalerl/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
# gRPC CurveService, Prometheus /metrics (deploy/base/curve.yaml).
EXPOSE 50053 9103
ENTRYPOINT ["scalerl-curve"]
CMD ["--host", "0.0.0.0", "--port", "50053", "--metrics-port", "9103"]
