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


def test_the_image_installs_the_locked_dependencies_only():
    """The image installs its dependencies from a hashed lock with the test venv's pins, then the
    package without resolving anything."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "pip install --require-hashes -r /src/requirements-image.lock" in dockerfile
    assert "pip install --no-deps --no-build-isolation /src" in dockerfile

    def pins(name: str) -> dict[str, str]:
        text = (ROOT / name).read_text()
        return dict(re.findall(r"^([A-Za-z0-9_.\-]+)==(\S+) \\$", text, re.MULTILINE))

    image, venv = pins("requirements-image.lock"), pins("requirements.lock")
    assert image
    assert {name: venv.get(name) for name in image} == image
    assert "pytest" not in image
