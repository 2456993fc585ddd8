"""The container image: it carries every package and is the one the manifests run."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).parents[2]
IMAGE = "ghcr.io/infermeter/infermeter"


def _pyproject() -> dict[str, object]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_dockerfile_copies_every_package():
    """Each package setuptools installs is copied into the build, or pip install would miss it."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    include = _pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]  # type: ignore[index]
    copied = set(re.findall(r"^COPY (\w+) /src/\1$", dockerfile, re.MULTILINE))
    assert {p.rstrip("*") for p in include} == copied
    assert 'ENTRYPOINT ["infermeter"]' in dockerfile


def test_manifests_run_this_version_of_the_image():
    """Every infermeter container in deploy/kubernetes uses the image tagged with this version."""
    version = _pyproject()["project"]["version"]  # type: ignore[index]
    images = set()
    for path in (ROOT / "deploy" / "kubernetes").glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            template = (doc or {}).get("spec", {}).get("template", {})
            for container in template.get("spec", {}).get("containers", []):
                if container["image"].startswith(IMAGE):
                    images.add(container["image"])
    assert images == {f"{IMAGE}:{version}"}
