"""The FinOps reference validator (focus-validator 1.0.0), run from its own venv on a file.

The venv is ``.venv-focus`` at the project root (``make focus-venv``), or the one named by
``INFERMETER_FOCUS_VENV``, so several checkouts can share one build of it.
"""

from __future__ import annotations

import os
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
FOCUS_VENV = Path(os.environ.get("INFERMETER_FOCUS_VENV") or ROOT / ".venv-focus")


def _focus_validator() -> tuple[Path, Path]:
    exe = FOCUS_VENV / "bin" / "focus-validator"
    if not exe.exists():
        pytest.fail(f"{exe} is missing: run `make focus-venv` (part of `make test`)")
    site = subprocess.run(
        [
            FOCUS_VENV / "bin" / "python",
            "-c",
            "import focus_validator, os; print(os.path.dirname(os.path.dirname(focus_validator.__file__)))",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return exe, Path(site)


def focus_1_0_failures(path: Path, report: Path) -> tuple[int, list[str]]:
    """How many checks focus-validator ran on the FOCUS 1.0 file ``path``, and which failed."""
    exe, site = _focus_validator()
    # The validator reads its data files relative to its package folder and exits 0 even when
    # checks fail, so it runs from there and its junit report is what decides.
    subprocess.run(
        [
            exe,
            "--data-file",
            path,
            "--validate-version",
            "1.0",
            "--output-type",
            "unittest",
            "--output-destination",
            report,
        ],
        cwd=site,
        check=True,
        capture_output=True,
        timeout=120,
    )
    cases = ET.parse(report).getroot().findall(".//testcase")
    failures = [
        str(c.get("name"))
        for c in cases
        if c.find("failure") is not None or c.find("error") is not None
    ]
    return len(cases), failures


def known_versions() -> set[str]:
    """The FOCUS versions focus-validator has rules for (its ``version_sets.yaml``)."""
    _, site = _focus_validator()
    sets = yaml.safe_load((site / "focus_validator" / "rules" / "version_sets.yaml").read_text())
    return {str(v) for v in sets}
