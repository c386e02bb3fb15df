# Stand-ins from Debian's packages for the third-party images docker-compose.yml pulls
# (redis:7.0-alpine, haproxy:3.0, prom/prometheus), for a machine that reaches no image registry:
# one image, three commands (docker/test/compose.cpu.yml). Grafana has no Debian package: the
# CPU stack leaves it out. BASE_IMAGE: any Debian bookworm image (docker/base.sh builds one).
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        redis-server haproxy prometheus \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb
USER 10001:10001
WORKDIR /tmp
