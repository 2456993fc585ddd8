# The infermeter image: one entry point for every part (sidecar, collect, billing, dashboard,
# autoscale, alerts). Build: docker build -t ghcr.io/infermeter/infermeter:0.1.0 .
# The base is pinned by digest, so a rebuild starts from the same bytes: Python 3.11.7 on Debian 12
# (bookworm). To move it, look the new digest up (docker buildx imagetools inspect
# python:<version>-slim-bookworm) and change the tag and the digest together.
FROM python:3.11.7-slim-bookworm@sha256:8f64a67710f3d981cf3008d6f9f1dbe61accd7927f165f4e37ea3f8b883ccc3f

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# The dependencies first, each pinned and checked against its hash (`make lock` writes the
# file), so the image holds exactly the versions the tests ran; then the package, with no
# dependency resolution left to do. Only what the package needs is copied: the build context
# also holds virtualenvs and caches.
COPY requirements-image.lock /src/
RUN pip install --require-hashes -r /src/requirements-image.lock
COPY pyproject.toml README.md /src/
COPY launcher /src/launcher
COPY infermeter /src/infermeter
COPY simulator /src/simulator
COPY sidecar /src/sidecar
COPY collectors /src/collectors
COPY billing /src/billing
COPY exporters /src/exporters
COPY dashboards /src/dashboards
COPY alerts /src/alerts
RUN pip install --no-deps --no-build-isolation /src && rm -rf /src

# The manifests run it as this user with a read-only root; state lives in /var/lib/infermeter.
RUN useradd --uid 10001 --user-group --home-dir /var/lib/infermeter --create-home infermeter
USER 10001
WORKDIR /var/lib/infermeter

ENTRYPOINT ["infermeter"]
CMD ["--help"]
