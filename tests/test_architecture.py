"""What docs/architecture.md says of the code's shape holds: no import circle anywhere."""

from __future__ import annotations

import grimp

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
