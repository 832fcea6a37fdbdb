# The OpenAI-compatible HTTP API: `kvservice api` (/v1/models, /v1/completions,
# /v1/chat/completions, /health and /metrics, all on 8000). No torch: the API is a client
# of the allocator and of the workers, which compute the model.
#
#   docker build -f deploy/docker/api.Dockerfile -t kvservice/api:0.1.0 .
#
# Set KVSERVICE_ALLOCATOR (host:port; the workers are its pools' addresses) and the API key
# (KVSERVICE_API_KEY, or `--api-key-file FILE`; neither: no key asked). See
# `kvservice api --help`.

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
 && pip install ".[api]" \
 && pip uninstall -y grpcio-tools

FROM ${PYTHON_IMAGE}
RUN useradd --system --uid 10001 --user-group --create-home --home-dir /home/kvservice kvservice
COPY --from=build /opt/kvservice /opt/kvservice
# TLS (docs/security.md): the API is a client of the allocator and the workers: mount the
# CA and its client certificate (CN = its tenant name, O = tenant; client.pem) at /certs.
# Its own HTTP is plain unless `--tls-cert` and `--tls-key` are given (then the health
# check below must ask https://).
ENV PATH=/opt/kvservice/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    KVSERVICE_TLS_CA=/certs/ca.pem \
    KVSERVICE_CLIENT_CERT=/certs/client.pem \
    KVSERVICE_CLIENT_KEY=/certs/client-key.pem
USER 10001:10001
WORKDIR /home/kvservice
EXPOSE 8000
# (python:3.11-slim has neither curl nor wget)
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=3)"]
CMD ["kvservice", "api", "--host", "0.0.0.0", "--port", "8000"]
