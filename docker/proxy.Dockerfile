# The proxy alone: light, no vLLM, no torch; runs as an unprivileged user (uid 10001).
# BASE_IMAGE: any Debian-like image with python3 >= 3.11 and its venv module; the default is the
# one users pull, the compose test builds one offline from Debian's archive (docker/base.sh).
# WHEELS: a folder of the build context with the wheels to install from instead of PyPI
# (docker/wheelhouse.sh); the default holds none.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE} AS build
ARG WHEELS=docker/wheels
COPY ${WHEELS}/ /tmp/wheels/
COPY pyproject.toml README.md /src/
COPY proxy /src/proxy
RUN python3 -m venv /opt/tierproxy \
    && if ls /tmp/wheels/*.whl >/dev/null 2>&1; then offline=--no-index; else offline=; fi \
    && /opt/tierproxy/bin/pip install --no-cache-dir --disable-pip-version-check -q $offline \
        --find-links /tmp/wheels /src \
    && /opt/tierproxy/bin/pip uninstall -y -q pip \
    && /opt/tierproxy/bin/tierproxy --help >/dev/null

FROM ${BASE_IMAGE}
COPY --from=build /opt/tierproxy /opt/tierproxy
ENV PATH=/opt/tierproxy/bin:$PATH HOME=/tmp PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
USER 10001:10001
EXPOSE 8000 8001
# Ready = at least one backend can serve (503 otherwise). Port 8000: the listen port of the
# configs here; a config that listens elsewhere overrides the check (compose: healthcheck).
HEALTHCHECK --interval=10s --timeout=5s --start-period=15s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/readyz', timeout=3)"]
# SIGTERM: stop taking connections and finish what is in flight; SIGHUP: reload the config.
# Both work with the server as PID 1 (it installs its own handlers) and under an init
# (compose `init: true`, which also reaps any child).
ENTRYPOINT ["tierproxy"]
CMD ["serve", "-c", "/etc/tierproxy/config.yaml"]
