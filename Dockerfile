# The xds-server image: the xDS gRPC server (18000) and its admin/metrics endpoint (9000).
#
# Two stages from one base. The builder turns this repository into a wheel; the runtime
# stage installs that wheel and its dependencies (all pure Python or manylinux wheels, so no
# compiler is needed anywhere) and runs as an unprivileged, numeric user so that Kubernetes'
# runAsNonRoot can verify it. tests/test_dockerfile.py checks these properties.
#
# Needs BuildKit (the default builder since Docker 23) for RUN --mount.
#
# Base image: the official python:3.11.15-slim-bookworm, pinned by its multi-platform OCI
# index digest (linux/amd64 and linux/arm64), so a rebuild gets the same bytes. The tag is
# kept for the reader; the digest decides. To move to a newer patch release or Debian
# update, look the digest up and change both FROM lines together:
#   docker buildx imagetools inspect python:3.11.<N>-slim-bookworm

FROM python:3.11.15-slim-bookworm@sha256:b18992999dbe963a45a8a4da40ac2b1975be1a776d939d098c647482bcad5cba AS builder

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
# Only what the wheel is made of; .dockerignore keeps the rest of the context out.
# README.m[d] is the readme pyproject.toml names, copied when it exists: a glob that matches
# nothing is allowed beside a source that does (setuptools only warns without it). LICENSE
# is pyproject.toml's license-files: the build fails without it.
COPY pyproject.toml README.m[d] LICENSE image-requirements.txt ./
COPY xds_server/ xds_server/
RUN pip wheel --no-deps --wheel-dir /wheels . && cp image-requirements.txt /wheels/


FROM python:3.11.15-slim-bookworm@sha256:b18992999dbe963a45a8a4da40ac2b1975be1a776d939d098c647482bcad5cba AS runtime

LABEL org.opencontainers.image.title="xds-server" \
      org.opencontainers.image.description="xDS management server for GPU-aware balancing of LLM inference traffic by a stock Envoy." \
      org.opencontainers.image.licenses="Apache-2.0"

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN groupadd --system --gid 10001 xds \
    && useradd --system --uid 10001 --gid 10001 --no-create-home \
        --home-dir /nonexistent --shell /usr/sbin/nologin xds

# The wheel is bind-mounted from the builder, so it leaves no layer behind. The
# dependencies are exactly image-requirements.txt's pins, checked against their hashes;
# the wheel adds nothing more (--no-deps), and pip check fails the build if a pin no
# longer satisfies pyproject.toml. pip compiles the .pyc files here, as root: the server
# cannot write to site-packages at run time.
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install --require-hashes --no-deps -r /wheels/image-requirements.txt \
    && pip install --no-deps /wheels/xds_server-*.whl \
    && pip check

USER 10001:10001

# 18000: xDS (ADS) gRPC for Envoy. 9000: admin, health and Prometheus metrics.
EXPOSE 18000 9000

# `xds-server run` binds 127.0.0.1 unless told otherwise, which nothing outside the
# container can reach: the image binds all interfaces instead, over mutual TLS with the
# certificate, key and client CA mounted at /etc/xds-server/tls (a Kubernetes TLS Secret's
# layout: tls.crt, tls.key, ca.crt).
ENTRYPOINT ["xds-server"]
CMD ["run", "--config", "/etc/xds-server/config.yaml", "--xds-address", "0.0.0.0", "--admin-address", "0.0.0.0", "--tls-cert", "/etc/xds-server/tls/tls.crt", "--tls-key", "/etc/xds-server/tls/tls.key", "--tls-client-ca", "/etc/xds-server/tls/ca.crt"]
