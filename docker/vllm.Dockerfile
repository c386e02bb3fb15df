# The official vLLM OpenAI image with the tierproxy plugin installed into its environment
# (the vllm.general_plugins entry point registers it; the flags in docker-compose.yml wire it).
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_IMAGE}
COPY pyproject.toml README.md /opt/tierproxy/
COPY proxy /opt/tierproxy/proxy
# --no-deps: vLLM's image already has everything the plugin imports; never replace its torch.
RUN pip install --no-cache-dir --no-deps /opt/tierproxy && \
    python -c "import proxy.vllm_plugin.scheduler, proxy.vllm_plugin.middleware"
