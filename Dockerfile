# The tiered-ckpt uploader sidecar (no torch: the core never imports it).
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY tiered_ckpt ./tiered_ckpt
RUN pip install . && useradd --uid 1000 --create-home sidecar
USER sidecar
EXPOSE 9100
ENTRYPOINT ["tiered-ckpt", "--log-level", "INFO"]
CMD ["upload", "--watch"]
