FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md alembic.ini ./
COPY sluice sluice
COPY launcher launcher
COPY web web
COPY workers workers
COPY models models
COPY migrations migrations
RUN pip install --no-cache-dir -e .
ENV SLUICE_WEB_HOST=0.0.0.0 SLUICE_DATA_DIR=/var/lib/sluice
EXPOSE 8000 5555
CMD ["sluice", "web"]
