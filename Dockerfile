# The slogate gateway (and its built-in engine simulator: `slogate sim`).
#   docker build -t slogate .
#   docker run -p 8080:8080 -v $PWD/my.toml:/etc/slogate/slogate.toml:ro slogate
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /build
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY backends ./backends
RUN pip install . && cd / && rm -rf /build

RUN useradd --system --uid 10001 --no-create-home slogate
USER slogate
WORKDIR /
EXPOSE 8080

# Liveness only: /readyz also turns false while a model has no healthy replica, which is the
# balancer's business, not a reason to call the container unhealthy.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2)"]

ENTRYPOINT ["slogate"]
CMD ["serve", "--config", "/etc/slogate/slogate.toml", "--host", "0.0.0.0"]
