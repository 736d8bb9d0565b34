# syntax=docker/dockerfile:1
# Two images from one file:
#   docker build -t sluice .                   every Sluice process, with the simulated engine (the default)
#   docker build --target gpu -t sluice:gpu .  a GPU worker serving a real model with vLLM
# No model is baked in: mount its directory and set SLUICE_MODEL_PATH (see docker-compose.yml).

# A CUDA runtime your driver supports (`nvidia-smi` shows the newest CUDA version it does).
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# The source both images install, listed once.
FROM scratch AS source
COPY pyproject.toml README.md alembic.ini /app/
COPY core /app/core
COPY launcher /app/launcher
COPY web /app/web
COPY workers /app/workers
COPY models /app/models
COPY migrations /app/migrations

FROM ${CUDA_IMAGE} AS gpu
# The CUDA image's environment (NVIDIA_DRIVER_CAPABILITIES=compute,utility) is what makes the NVIDIA
# container runtime mount the driver's compute libraries. Triton, under vLLM, compiles small C
# launchers when a worker starts: it needs a C compiler and Python's headers.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/sluice
ENV PATH=/opt/sluice/bin:$PATH
WORKDIR /app
COPY --from=source /app /app
RUN pip install --no-cache-dir -e '.[vllm]'
ENV SLUICE_WEB_HOST=0.0.0.0 SLUICE_DATA_DIR=/var/lib/sluice SLUICE_ENGINE=vllm
CMD ["sluice", "worker"]

# The default target (the last stage): BuildKit builds the gpu stage only when asked for it.
FROM python:3.11-slim AS app
WORKDIR /app
COPY --from=source /app /app
RUN pip install --no-cache-dir -e .
ENV SLUICE_WEB_HOST=0.0.0.0 SLUICE_DATA_DIR=/var/lib/sluice
EXPOSE 8000 5555
CMD ["sluice", "web"]
