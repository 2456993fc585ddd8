"""What docs/architecture.md says of the code's shape holds: every module in its tables, no
import circle anywhere."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import grimp

ROOT = Path(__file__).parents[1]
ARCHITECTURE = ROOT / "docs" / "architecture.md"

PRODUCT = (
    "launcher",
    "infermeter",
    "simulator",
    "sidecar",
    "collectors",
    "billing",
    "exporters",
    "dashboards",
    "alerts",
)


def test_no_module_imports_itself_back() -> None:
    """No product module reaches itself again through the modules it imports (type-only imports too)."""
    graph = grimp.build_graph(*PRODUCT)
    circles = set()
    for module in sorted(graph.modules):
        for imported in graph.find_modules_directly_imported_by(module):
            chain = graph.find_shortest_chain(importer=imported, imported=module)
            if chain is not None:
                circles.add(" -> ".join((module, *chain)))
    assert sorted(circles) == []


def _holds_code(path: Path) -> bool:
    """A module other than a package's ``__init__.py``, or an ``__init__.py`` with more than a
    docstring (a version, re-exports): what a reader would look for in the tables."""
    if path.name != "__init__.py":
        return True
    body = ast.parse(path.read_text()).body
    return any(
        not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
        and not (isinstance(node, ast.ImportFrom) and node.module == "__future__")
        for node in body
    )


def _modules() -> set[str]:
    return {
        path.relative_to(ROOT).as_posix()
        for package in PRODUCT
        for path in (ROOT / package).rglob("*.py")
        if _holds_code(path)
    }


def _tabled() -> set[str]:
    """``package/module.py`` for every row of the Modules section's tables."""
    section = ARCHITECTURE.read_text().split("\n## Modules\n", 1)[1].split("\n## ", 1)[0]
    names: set[str] = set()
    package = None
    for line in section.splitlines():
        heading = re.fullmatch(r"### `([\w/]+)/`", line)
        if heading:
            package = heading.group(1)
        elif package and line.startswith("| `"):
            first_cell = line.split(" | ")[0]
            names.update(f"{package}/{name}" for name in re.findall(r"`([\w.]+\.py)`", first_cell))
    return names


def test_the_module_tables_list_every_module() -> None:
    """Every product module has its row in docs/architecture.md's Modules section."""
    assert sorted(_modules() - _tabled()) == []


def test_the_module_tables_name_no_module_that_is_gone() -> None:
    """Every row of the Modules section names a module that exists."""
    assert sorted(_tabled() - _modules()) == []


# Where the product may read the process's environment: the configuration, which every other
# module asks (``env_value``, ``process_environment``), and the pod's identity (downward API).
ENVIRONMENT_READERS = {"infermeter/config.py", "infermeter/identity.py"}


def _reads_environment(path: Path) -> bool:
    """``os.environ``, ``os.getenv`` or either imported from ``os`` anywhere in the module."""
    names = ("environ", "environb", "getenv", "getenvb")
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in names
            and isinstance(node.value, ast.Name)
            and node.value.id == "os"
        ):
            return True
        if (
            isinstance(node, ast.ImportFrom)
            and node.module == "os"
            and any(alias.name in names for alias in node.names)
        ):
            return True
    return False


def test_only_the_configuration_reads_the_environment() -> None:
    """No product module but the configuration and the identity module reads os.environ."""
    readers = {
        path.relative_to(ROOT).as_posix()
        for package in PRODUCT
        for path in (ROOT / package).rglob("*.py")
        if _reads_environment(path)
    }
    assert sorted(readers - ENVIRONMENT_READERS) == []


# The one module that opens DuckDB connections: the service's ledger and every other one (a
# restore's file, a scratch database) come from it, so what can hold a ledger file is in one place.
CONNECTION_OPENERS = {"billing/ledger.py"}


def _opens_duckdb(path: Path) -> bool:
    """``duckdb.connect(...)`` called, or ``connect`` imported from ``duckdb``, in the module."""
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Attribute)
            and node.attr == "connect"
            and isinstance(node.value, ast.Name)
            and node.value.id == "duckdb"
        ):
            return True
        if (
            isinstance(node, ast.ImportFrom)
            and node.module == "duckdb"
            and any(alias.name == "connect" for alias in node.names)
        ):
            return True
    return False


def test_only_the_ledger_module_opens_duckdb_connections() -> None:
    """No product module but billing/ledger.py calls duckdb.connect."""
    openers = {
        path.relative_to(ROOT).as_posix()
        for package in PRODUCT
        for path in (ROOT / package).rglob("*.py")
        if _opens_duckdb(path)
    }
    assert sorted(openers - CONNECTION_OPENERS) == []
    assert openers == CONNECTION_OPENERS
