"""Installs are reproducible: every package comes from a lock with hashes, the image from a digest.

Adversaries: a compromised or re-uploaded release on the package index (a hash that does not
match stops the install), a dependency that resolves differently from one day to the next, and a
base image re-pushed under the same tag.
"""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).parents[2]
LOCK = ROOT / "requirements.lock"
_PIN = re.compile(
    # name==version, an optional environment marker (``; sys_platform != "win32"``), the hashes
    r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)(?: ;[^\\\n]*[^\\\n ])?((?: \\\n\s+--hash=sha256:[0-9a-f]{64})*)",
    re.M,
)


def _pins() -> dict[str, tuple[Version, int]]:
    """Each locked package's version and how many hashes it has."""
    return {
        canonicalize_name(name): (Version(version), hashes.count("--hash="))
        for name, version, hashes in _PIN.findall(LOCK.read_text())
    }


def _named() -> list[Requirement]:
    """Every requirement pyproject.toml names: dependencies, the dev extra, the build backend."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    names = [
        *project["project"]["dependencies"],
        *project["project"]["optional-dependencies"]["dev"],
        *project["build-system"]["requires"],
    ]
    return [Requirement(r) for r in names]


def _make_dry_run(target: str) -> str:
    """The commands ``make`` would run for ``target``, rebuilding it whatever its state."""
    done = subprocess.run(
        ["make", "-n", "-B", target], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return done.stdout


@pytest.mark.parametrize("requirement", _named(), ids=str)
def test_the_lock_pins_every_named_dependency_within_its_range(requirement):
    """Each requirement of pyproject.toml is locked, with hashes, at a version its range allows."""
    pins = _pins()
    assert canonicalize_name(requirement.name) in pins, f"{requirement.name} is not locked"
    version, hashes = pins[canonicalize_name(requirement.name)]
    assert requirement.specifier.contains(version, prereleases=True), (requirement, version)
    assert hashes > 0


def test_every_locked_package_has_a_hash():
    """pip's hash-checking mode refuses a lock in which any package lacks a hash."""
    text = LOCK.read_text()
    pinned = re.findall(r"^[A-Za-z0-9][A-Za-z0-9._-]*==", text, re.M)
    assert len(_pins()) == len(pinned) > 50
    assert all(hashes > 0 for _, hashes in _pins().values())
    assert not re.search(r"^-(-extra-index-url|-index-url|-find-links|i|f) ", text, re.M)


def test_make_installs_from_the_lock_with_hashes():
    """The venv is installed from the lock in hash-checking mode, then the project without deps."""
    commands = _make_dry_run(".venv/.installed-stamp").splitlines()
    installs = [c for c in commands if " -m pip install " in c]
    assert len(installs) == 2
    assert installs[0].endswith("--require-hashes -r requirements.lock")
    assert installs[1].endswith("--no-deps --no-build-isolation -e .")


def test_the_install_stamp_depends_on_the_lock():
    """A changed lock makes ``make`` reinstall."""
    makefile = (ROOT / "Makefile").read_text()
    prerequisites = re.search(r"^\$\(STAMP\):(.*)$", makefile, re.M)
    assert prerequisites is not None
    assert "$(LOCK)" in prerequisites.group(1).split()
    assert re.search(r"^LOCK := requirements\.lock$", makefile, re.M)


def test_make_lock_regenerates_the_lock_with_hashes():
    """``make lock`` resolves pyproject.toml and its dev extra into the lock, with hashes."""
    command = " ".join(_make_dry_run("lock").replace("\\\n", " ").split())
    assert "pip-compile" in command
    for option in (
        "--generate-hashes",
        "--allow-unsafe",
        "--extra dev",
        "--output-file requirements.lock pyproject.toml",
    ):
        assert option in command


def test_the_base_image_is_pinned_by_digest():
    """The Dockerfile's FROM names its base image by an immutable sha256 digest."""
    froms = re.findall(r"^FROM\s+(\S+)", (ROOT / "Dockerfile").read_text(), re.M)
    assert froms
    for image in froms:
        assert re.fullmatch(r"[\w.\-/:]+@sha256:[0-9a-f]{64}", image), image
