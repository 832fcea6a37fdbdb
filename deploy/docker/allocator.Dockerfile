# An allocator replica: `kvservice serve` (gRPC on 50051, /metrics on 9400).
#
#   docker build -f deploy/docker/allocator.Dockerfile -t kvservice/allocator:0.1.0 .
#
# Set KVSERVICE_REDIS_URL (redis://host:6379/0); without it the replica starts a private
# embedded Redis, which is fine for a try-out and wrong for more than one replica.

# The base image: Docker Hub's python:3.11-slim, or any Debian-based image with Python 3.11
# as `python` (scripts/compose_check.sh builds such a stand-in where Docker Hub is unreachable).
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/kvservice
ENV PATH=/opt/kvservice/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY proto proto
COPY kvservice kvservice
COPY worker worker
COPY kernels kernels
# kvservice/v1/ is generated here, as `make proto` does; grpcio-tools stays in this stage.
RUN pip install "grpcio-tools>=1.70,<2" \
 && python -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. proto/kvservice/v1/*.proto \
 && touch kvservice/v1/__init__.py \
 && pip install . \
 && pip uninstall -y grpcio-tools

FROM ${PYTHON_IMAGE}
# (/certs is made here, owned by the user, so that a new named volume mounted there takes
# that owner: the one-shot certificates job runs this image and writes into it)
RUN useradd --system --uid 10001 --user-group --create-home --home-dir /home/kvservice kvservice \
 && mkdir -m 0755 /certs && chown 10001:10001 /certs
COPY --from=build /opt/kvservice /opt/kvservice
# TLS (docs/security.md): mount the CA and certificates at /certs (`kvservice certs /certs
# ...` makes development ones); the health check presents the server certificate.
ENV PATH=/opt/kvservice/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    KVSERVICE_HOST=0.0.0.0 \
    KVSERVICE_PORT=50051 \
    KVSERVICE_METRICS_PORT=9400 \
    KVSERVICE_TLS_CERT=/certs/server.pem \
    KVSERVICE_TLS_KEY=/certs/server-key.pem \
    KVSERVICE_TLS_CLIENT_CA=/certs/ca.pem \
    KVSERVICE_TLS_CA=/certs/ca.pem \
    KVSERVICE_CLIENT_CERT=/certs/server.pem \
    KVSERVICE_CLIENT_KEY=/certs/server-key.pem
USER 10001:10001
WORKDIR /home/kvservice
EXPOSE 50051 9400
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
  CMD ["kvservice", "health", "--target", "127.0.0.1:50051"]
CMD ["kvservice", "serve"]
