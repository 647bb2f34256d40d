# syntax=docker/dockerfile:1

# Build stage: install agent-runner and its dependencies into a virtualenv.
FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY app ./app
RUN pip install --no-cache-dir .

# Final stage: the virtualenv, the migrations, a non-root user; no compilers.
FROM python:3.11-slim
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    DATABASE_URL=sqlite:////data/agent_runner.db \
    DEMO_OUTBOX=/data/demo-outbox.jsonl
RUN useradd --system --uid 10001 --create-home --home-dir /home/agent agent \
    && mkdir /data \
    && chown agent /data
COPY --from=build /opt/venv /opt/venv
WORKDIR /srv/agent-runner
COPY migrations ./migrations
USER 10001
VOLUME ["/data"]
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2)"]
ENTRYPOINT ["agent-runner"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
