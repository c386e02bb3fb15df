# The proxy alone: light, no vLLM, no torch.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md /app/
COPY proxy /app/proxy
RUN pip install --no-cache-dir /app
USER nobody
EXPOSE 8000
ENTRYPOINT ["tierproxy"]
CMD ["serve", "-c", "/etc/tierproxy/config.yaml"]
