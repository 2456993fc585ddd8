"""Billing's OpenAPI held to what the service does: schemathesis sends generated requests to every
route and checks each answer against the document (status, content type, body), and that every
request the document allows is taken."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import schemathesis

# Loaded with this module, not by the first test's ``from_asgi``: pytest rewrites a plugin's
# modules as they are imported (schemathesis is one), and CPython 3.11's compiler fails with a
# SystemError ("AST constructor recursion depth mismatch") when a finalizer of another test's
# leftovers runs in the middle of it.
import schemathesis.specs.openapi.schemas
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    positive_data_acceptance,
    response_schema_conformance,
    status_code_conformance,
)

from billing.api import create_app
from billing.bounds import SampleBounds
from billing.ledger import Ledger
from infermeter.config import DEFAULT_CONFIG, Config, load_config
from infermeter.months import month_bounds, month_of
from infermeter.wire import ARROW_STREAM, NDJSON
from tests.billing.conftest import OCT, batch, gpu_samples, usage
from tests.conftest import config_ledger

ADMIN, INGEST = "im-demo-admin", "im-demo-ingest"

# The ingest bodies go on the wire as they are: NDJSON as text, an Arrow stream as bytes.
schemathesis.serializer.alias(NDJSON, "text/plain")
schemathesis.serializer.alias(ARROW_STREAM, "application/octet-stream")


def _config(tmp_path: Path) -> Config:
    """The demo configuration with no read limit, taking the shared ingest token."""
    config = load_config(
        DEFAULT_CONFIG, environ={"INFERMETER__BILLING__SHARED_INGEST_TOKEN": "true"}
    )
    return config.model_copy(
        update={
            "billing": config.billing.model_copy(
                update={
                    "read_burst": 1_000_000,
                    "export_dir": str(tmp_path),
                    "backup_dir": str(tmp_path / "backups"),
                    "retention": config.billing.retention.model_copy(
                        update={"archive": str(tmp_path / "archive")}
                    ),
                }
            )
        }
    )


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Any]:
    """Billing's OpenAPI over its ASGI app, on an empty in-memory ledger, with no read limit."""
    config = _config(tmp_path)
    ledger = config_ledger(config)
    try:
        yield schemathesis.openapi.from_asgi("/openapi.json", create_app(config, ledger))
    finally:
        ledger.close()


@pytest.fixture
def absurd_api(tmp_path: Path) -> Iterator[Any]:
    """The same over a ledger holding, this month, one GPU sample of 1e22 J (kept as a ledger from
    before the sample bounds would hold it) beside ordinary samples and usage."""
    config = _config(tmp_path)
    ledger = Ledger.open(
        ":memory:", [t.name for t in config.teams], {}, bounds=SampleBounds({"L40S": 1e30})
    )
    now = time.time()
    start = max(month_bounds(month_of(now))[0], now - 900)
    absurd = gpu_samples("small-1", start + 300, 10.0, gpu="1")[0] | {"energy_joules": 1e22}
    for kind, records in (
        ("gpu_samples", gpu_samples("small-0", start, 600.0)),
        ("gpu_samples", [absurd]),
        ("usage", [usage("search", start + 60, 30.0)]),
    ):
        assert ledger.ingest(batch(kind, records), now=now).rejected == []
    try:
        yield schemathesis.openapi.from_asgi("/openapi.json", create_app(config, ledger))
    finally:
        ledger.close()


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    positive_data_acceptance,
]


def checks_for(case: Any) -> list[Any]:
    """The checks a case is held to.

    Two refusals of schema-valid requests are right and cannot be told apart in OpenAPI: an
    Arrow body (or an invoice file) is "binary" to it, and most bytes are not an Arrow stream
    (a FOCUS export) (400); a query's range
    (and the fleet's range of decisions, the audit trail's) must have ``to`` after ``from``, and a
    query's span at most 93 days, a rule between two parameters (400). Those cases are held to every check but
    the acceptance of schema-valid data.
    """
    # An invoice is a FOCUS file: OpenAPI says "a string" (CSV) or "binary" (Parquet), and
    # most strings are not a FOCUS export (400 naming the row and column).
    arrow = case.media_type == ARROW_STREAM or case.path == "/v1/invoices"
    ranged = case.path in (
        "/v1/query/{name}",
        "/v1/fleet",
        "/v1/audit",
        "/v1/audit.csv",
        "/v1/events",
        "/v1/allocation",
        "/v1/allocation.csv",
    ) and bool(case.query)
    # A key is issued for a team the configuration names, with one expiry form, a rotation's
    # grace at most a week: rules between a body and the configuration.
    # An override is granted to a team the configuration names, with a reason that is not
    # blank: the same rules between a body and the configuration.
    ranged = ranged or case.path in (
        "/v1/keys",
        "/v1/keys/{key_id}/rotate",
        "/v1/admin/budget-overrides",
    )
    return [c for c in CHECKS if c is not positive_data_acceptance or not (arrow or ranged)]


def exercise(operation: Any, token: str, examples: int = 30, acceptance: bool = True) -> None:
    """Send ``operation`` its generated requests with ``token``; the first failures found are raised.

    Without ``acceptance``, a refusal of a schema-valid request is not held against the route.
    """

    @given(case=operation.as_strategy())
    @settings(
        max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None
    )
    def check(case: Any) -> None:
        checks = [c for c in checks_for(case) if acceptance or c is not positive_data_acceptance]
        case.call_and_validate(headers={"authorization": f"Bearer {token}"}, checks=checks)

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


def _deep(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def _gpu_line(**fields: bytes) -> bytes:
    """A GPU sample as JSON text, with ``fields`` spelled as given (numbers no parser holds)."""
    line = orjson.dumps(gpu_samples(start=OCT + 3600, seconds=10)[0] | dict.fromkeys(fields, 0))
    for name, text in fields.items():
        line = line.replace(f'"{name}":0'.encode(), f'"{name}":'.encode() + text)
    return line


# Bodies built to break the service rather than the schema: nesting past the parsers' recursion,
# numbers past any float or integer, a huge array where a string goes, and samples no board can
# draw. Each as the JSON batch and as NDJSON lines.
HOSTILE_RECORDS = {
    "a record nested 1,000 deep": _deep(1_000),
    "a record nested 100,000 deep": _deep(100_000),
    "a field nested 1,000 deep": b'{"request_id": ' + _deep(1_000) + b"}",
    "energy past any float": _gpu_line(energy_joules=b"1e400"),
    "an integer past 64 bits": _gpu_line(xid_errors=b"123456789012345678901234567890"),
    "a 5,000-digit integer": _gpu_line(xid_errors=b"9" * 5_000),
    "a 200,000-element array as an id": b'{"sample_id": [' + b",".join([b"1"] * 200_000) + b"]}",
    "energy of 1e15 J": _gpu_line(energy_joules=b"1e15"),
    "energy of 1e22 J": _gpu_line(energy_joules=b"1e22"),
}


def test_hostile_ingest_bodies_are_never_a_server_error(api: Any) -> None:
    """Deep nesting, absurd magnitudes and huge arrays on every ingest route: a 4xx or refused
    records, answered as the OpenAPI describes; never a 5xx."""
    checks = [c for c in CHECKS if c is not positive_data_acceptance]
    headers = {"authorization": f"Bearer {INGEST}"}
    failures = []
    for name, record in HOSTILE_RECORDS.items():
        for path, params, body, media_type in (
            ("/v1/ingest", {}, b'{"gpu_samples": [' + record + b"]}", "application/json"),
            ("/v1/ingest", {}, b'{"gpu_samples": ' + record + b"}", "application/json"),
            ("/v1/ingest/{kind}", {"kind": "gpu_samples"}, record.decode() + "\n", NDJSON),
            ("/v1/ingest/{kind}", {"kind": "usage"}, record.decode() + "\n", NDJSON),
        ):
            operation = api[path]["POST"]
            case = operation.Case(body=body, media_type=media_type, path_parameters=params)
            try:
                case.call_and_validate(headers=headers, checks=checks)
            except (Exception, BaseExceptionGroup) as exc:  # every body is tried; all are reported
                failures.append(f"{name} to {path} as {media_type}: {exc}")
    assert not failures, "\n\n".join(failures)


def test_every_read_route_serves_a_month_holding_an_absurd_row(absurd_api: Any) -> None:
    """Over a ledger that holds a sample of 1e22 J, the statement, file, spend, query and /metrics
    routes still answer only as their OpenAPI says, never a 5xx (they answered 500)."""
    reads = ("/v1/chargeback", "/v1/spend", "/v1/query", "/metrics")
    failures = []
    for result in absurd_api.get_all_operations():
        operation = result.ok()
        if operation.method.upper() != "GET" or not operation.path.startswith(reads):
            continue
        try:
            exercise(operation, ADMIN, examples=10, acceptance=False)
        except (Exception, BaseExceptionGroup) as exc:
            failures.append(f"{operation.label}: {exc}")
    assert not failures, "\n\n".join(failures)
