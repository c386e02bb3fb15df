# The official vLLM OpenAI image with the tierproxy plugin installed into its environment
# (the vllm.general_plugins entry point registers it; the flags in docker-compose.yml wire it).
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_IMAGE}
COPY pyproject.toml README.md /opt/tierproxy/
COPY proxy /opt/tierproxy/proxy
# --no-deps: vLLM's image already has everything the plugin imports; never replace its torch.
RUN pip install --no-cache-dir --no-deps /opt/tierproxy && \
    python -c "import proxy.vllm_plugin.scheduler, proxy.vllm_plugin.middleware"
# It keeps the official image's user: docker-compose.yml mounts the Hugging Face cache at
# /root/.cache/huggingface (the CPU image, docker/vllm-cpu.Dockerfile, runs as uid 10001).
HEALTHCHECK --interval=10s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=3)"]
