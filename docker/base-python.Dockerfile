# Debian's python3 (3.11 on bookworm) with its venv module on the imported Debian base
# (docker/base.sh): the BASE_IMAGE of the images built where python:3.11-slim cannot be pulled.
FROM tierproxy-debian:bookworm
RUN apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb
