"""Billing's OpenAPI held to what the service does: schemathesis sends generated requests to every
route and checks each answer against the document (status, content type, body), and that every
request the document allows is taken."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    positive_data_acceptance,
    response_schema_conformance,
    status_code_conformance,
)

from billing.api import create_app
from billing.ledger import Ledger
from infermeter.config import DEFAULT_CONFIG, load_config
from infermeter.wire import ARROW_STREAM, NDJSON

ADMIN, INGEST = "im-demo-admin", "im-demo-ingest"

# The ingest bodies go on the wire as they are: NDJSON as text, an Arrow stream as bytes.
schemathesis.serializer.alias(NDJSON, "text/plain")
schemathesis.serializer.alias(ARROW_STREAM, "application/octet-stream")


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Any]:
    """Billing's OpenAPI over its ASGI app, on an empty in-memory ledger, with no read limit."""
    config = load_config(DEFAULT_CONFIG, environ={})
    config = config.model_copy(update={"billing": config.billing.model_copy(
        update={"read_burst": 1_000_000, "export_dir": str(tmp_path)})})  # fmt: skip
    ledger = Ledger.open(":memory:", [t.name for t in config.teams],
                         {m.name: m.sla.ttft_p95_seconds for m in config.models})  # fmt: skip
    try:
        yield schemathesis.openapi.from_asgi("/openapi.json", create_app(config, ledger))
    finally:
        ledger.close()


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance, positive_data_acceptance]  # fmt: skip


def checks_for(case: Any) -> list[Any]:
    """The checks a case is held to.

    Two refusals of schema-valid requests are right and cannot be told apart in OpenAPI: an
    Arrow body is "binary" to it, and most bytes are not an Arrow stream (400); a query's range
    (and the fleet's range of decisions, the audit trail's) must have ``to`` after ``from``, and a
    query's span at most 93 days, a rule between two parameters (400). Those cases are held to every check but
    the acceptance of schema-valid data.
    """
    arrow = case.media_type == ARROW_STREAM
    ranged = case.path in ("/v1/query/{name}", "/v1/fleet", "/v1/audit", "/v1/audit.csv") and bool(
        case.query
    )
    # A key is issued for a team the configuration names, with one expiry form, a rotation's
    # grace at most a week: rules between a body and the configuration.
    ranged = ranged or case.path in ("/v1/keys", "/v1/keys/{key_id}/rotate")
    return [c for c in CHECKS if c is not positive_data_acceptance or not (arrow or ranged)]


def exercise(operation: Any, token: str) -> None:
    """Send ``operation`` its generated requests with ``token``; the first failures found are raised."""

    @given(case=operation.as_strategy())
    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck),
              database=None)  # fmt: skip
    def check(case: Any) -> None:
        case.call_and_validate(headers={"authorization": f"Bearer {token}"},
                               checks=checks_for(case))  # fmt: skip

    check()


def test_every_route_answers_as_its_openapi_says(api: Any) -> None:
    """Generated requests to every route get only the statuses, content types and bodies its OpenAPI describes."""
    failures = []
    for result in api.get_all_operations():
        operation = result.ok()
        token = INGEST if operation.path.startswith("/v1/ingest") else ADMIN
        try:
            exercise(operation, token)
        except (Exception, BaseExceptionGroup) as exc:  # every route is checked; all are reported
            failures.append(f"{operation.label}: {exc}")
    assert not failures, "\n\n".join(failures)
