# vLLM with the OpenTelemetry packages its --otlp-traces-endpoint needs (the official image
# does not ship them), for docker-compose's `gpu` profile.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.11.0
FROM ${VLLM_IMAGE}
RUN pip install --no-cache-dir \
      'opentelemetry-sdk>=1.26' 'opentelemetry-api>=1.26' \
      'opentelemetry-exporter-otlp>=1.26' 'opentelemetry-semantic-conventions-ai>=0.4.1'
