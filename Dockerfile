# The infermeter image: one entry point for every part (sidecar, collect, billing, dashboard,
# autoscale, alerts). Build: docker build -t ghcr.io/infermeter/infermeter:0.1.0 .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Only what the package needs: the build context also holds virtualenvs and caches.
COPY pyproject.toml README.md /src/
COPY infermeter /src/infermeter
COPY simulator /src/simulator
COPY sidecar /src/sidecar
COPY collectors /src/collectors
COPY billing /src/billing
COPY exporters /src/exporters
COPY dashboards /src/dashboards
COPY alerts /src/alerts
RUN pip install /src && rm -rf /src

# The manifests run it as this user with a read-only root; state lives in /var/lib/infermeter.
RUN useradd --uid 10001 --user-group --home-dir /var/lib/infermeter --create-home infermeter
USER 10001
WORKDIR /var/lib/infermeter

ENTRYPOINT ["infermeter"]
CMD ["--help"]
