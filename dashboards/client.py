"""The dashboards' only way to the ledger: the billing service's HTTP API, with the user's key.

Every call forwards the signed-in user's bearer token, so billing decides what the user may
see; the dashboard server holds no credential of its own and filters nothing itself. A 401
means billing no longer takes the token (a key revoked or expired): the client tells its
``refused`` hook, which ends the sessions signed in with it (``dashboards.sessions``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Literal

import httpx
import polars as pl

__all__ = ["STATEMENT_TIMEOUT_SECONDS", "Answer", "BillingClient", "BillingError", "Download"]

STATEMENT_TIMEOUT_SECONDS: Final = 120.0
_FILENAME: Final = re.compile(r'filename="([^"]+)"')


class BillingError(Exception):
    """Billing refused or failed a call; ``status`` is the HTTP status (0: unreachable)."""

    def __init__(self, status: int, message: str) -> None:
        self.status = status
        super().__init__(message)


@dataclass(frozen=True, slots=True)
class Download:
    """A file billing exported: its text and the name billing gave it."""

    text: str
    filename: str


@dataclass(frozen=True, slots=True)
class Answer:
    """A named query's rows and the range billing served: whole slots, ``step`` seconds each."""

    frame: pl.DataFrame
    start: float
    end: float
    step: int


class BillingClient:
    """Synchronous calls to one billing service (Dash callbacks run in worker threads)."""

    def __init__(
        self,
        base_url: str,
        timeout_seconds: float = 10.0,
        refused: Callable[[str], None] | None = None,
    ) -> None:
        self._http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout_seconds)
        self._refused = refused

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def _send(
        self,
        token: str,
        path: str,
        params: dict[str, Any] | None = None,
        timeout_seconds: float | None = None,
        body: dict[str, Any] | None = None,
    ) -> httpx.Response:
        """GET ``path`` (POST ``body`` when given) as ``token``; BillingError unless it succeeds."""
        timeout = self._http.timeout if timeout_seconds is None else httpx.Timeout(timeout_seconds)
        headers = {"authorization": f"Bearer {token}"}
        try:
            if body is None:
                response = self._http.get(path, params=params, headers=headers, timeout=timeout)
            else:
                response = self._http.post(path, json=body, headers=headers, timeout=timeout)
        except httpx.HTTPError as exc:
            raise BillingError(0, f"billing is unreachable: {exc}") from None
        if response.status_code not in (200, 201):
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text[:200]
            if response.status_code == 401 and self._refused is not None:
                self._refused(token)
            raise BillingError(response.status_code, message)
        return response

    def _get(
        self,
        token: str,
        path: str,
        params: dict[str, Any] | None = None,
        timeout_seconds: float | None = None,
    ) -> Any:
        return self._send(token, path, params, timeout_seconds).json()

    def whoami(self, token: str) -> dict[str, Any]:
        """The caller the token stands for, and the teams it may see (401/403: not a reader)."""
        body: dict[str, Any] = self._get(token, "/v1/query")
        return body

    def query(
        self,
        token: str,
        name: str,
        start: float,
        end: float,
        step: int | None = None,
        model: str | None = None,
    ) -> pl.DataFrame:
        """A named query over ``start``..``end`` as a frame (its columns even when empty)."""
        return self.answer(token, name, start, end, step, model).frame

    def answer(
        self,
        token: str,
        name: str,
        start: float,
        end: float,
        step: int | None = None,
        model: str | None = None,
    ) -> Answer:
        """A named query over ``start``..``end``, with the range and step billing served."""
        params: dict[str, Any] = {"from": start, "to": end}
        if step is not None:
            params["step"] = step
        if model is not None:
            params["model"] = model
        body = self._get(token, f"/v1/query/{name}", params)
        columns: list[str] = body["columns"]
        if not body["rows"]:
            # No rows, no types: text columns must not pass for numbers in later arithmetic.
            frame = pl.DataFrame(schema=dict.fromkeys(columns, pl.Null))
        else:
            frame = pl.DataFrame(
                body["rows"], schema=columns, orient="row", infer_schema_length=None
            )
        return Answer(frame, float(body["from"]), float(body["to"]), int(body["step"]))

    def statement(self, token: str, month: str) -> dict[str, Any]:
        """A month's statement as billing answers it (a team key gets its own lines only).

        From billing's statement cache (``/v1/query/statement/{month}``): at most one refresh
        old, with ``as_of``, the time billing read the ledger. When it has expired it is
        computed while we wait, which takes seconds on a large ledger, hence the long timeout.
        """
        body: dict[str, Any] = self._get(
            token, f"/v1/query/statement/{month}", timeout_seconds=STATEMENT_TIMEOUT_SECONDS
        )
        return body

    def federation_statement(self, token: str, month: str) -> dict[str, Any]:
        """A central billing's statement of ``month`` across its clusters, with which clusters
        are stale (``/v1/federation/statement/{month}``; readers of every team)."""
        body: dict[str, Any] = self._get(
            token, f"/v1/federation/statement/{month}", timeout_seconds=STATEMENT_TIMEOUT_SECONDS
        )
        return body

    def federation_hours(self, token: str, month: str) -> dict[str, Any]:
        """A central billing's figures of ``month``'s hours across its clusters, without the
        rows: per cluster whether its hourly cost adds up to its lines, its reconciliation and
        instance-hours (``/v1/federation/hours/{month}?rows=false``; readers of every team)."""
        body: dict[str, Any] = self._get(
            token,
            f"/v1/federation/hours/{month}?rows=false",
            timeout_seconds=STATEMENT_TIMEOUT_SECONDS,
        )
        return body

    def breakdown(self, token: str, month: str) -> dict[str, Any]:
        """A month's statement lines split by project and end user (a team key: its own rows).

        From the same cached statement as ``statement`` (``/v1/chargeback/{month}/breakdown``).
        """
        body: dict[str, Any] = self._get(
            token, f"/v1/chargeback/{month}/breakdown", timeout_seconds=STATEMENT_TIMEOUT_SECONDS
        )
        return body

    def spend(self, token: str) -> list[dict[str, Any]]:
        """Month-to-date spend, budget and forecast per visible team, each row with its ``as_of``.

        From the same cached statement as ``statement`` (``/v1/query/spend``), so the spend and
        the lines a page shows are one computation, and ``/v1/spend`` and the command line
        agree with them within one refresh.
        """
        body: list[dict[str, Any]] = self._get(
            token, "/v1/query/spend", timeout_seconds=STATEMENT_TIMEOUT_SECONDS
        )
        return body

    def efficiency(self, token: str, month: str) -> dict[str, Any]:
        """A month's efficiency figures and recommendations as billing answers them for this
        token (a team key gets its own rows and advice); computed from the month's rollups."""
        body: dict[str, Any] = self._get(
            token, f"/v1/efficiency/{month}", timeout_seconds=STATEMENT_TIMEOUT_SECONDS
        )
        return body

    def fleet(self, token: str, start: float, end: float) -> dict[str, Any]:
        """The fleet now (``/v1/fleet``, admin): per model its groups, live instances and the
        autoscaler's latest desired count, per group its live instances, and the scaling
        decisions made in ``start``..``end``, newest first."""
        body: dict[str, Any] = self._get(token, "/v1/fleet", {"from": start, "to": end})
        return body

    def allocation(self, token: str, params: dict[str, Any]) -> dict[str, Any]:
        """The allocation explorer's answer (``/v1/allocation``): rows, total, series, CSV.

        ``params``: from, to, by, and the filters (a key to a list of values). Building a month
        the first time costs billing a statement's allocation, hence the long timeout.
        """
        body: dict[str, Any] = self._get(
            token, "/v1/allocation", params, timeout_seconds=STATEMENT_TIMEOUT_SECONDS
        )
        return body

    def events(self, token: str, start: float, end: float) -> list[dict[str, Any]]:
        """What happened in ``start``..``end`` (``/v1/events``): scaling (admin) and month closes."""
        body: dict[str, Any] = self._get(token, "/v1/events", {"from": start, "to": end})
        events: list[dict[str, Any]] = body["events"]
        return events

    def span(self, token: str) -> tuple[float, float] | None:
        """The first and the end (Unix seconds) of the data this token may see; None: no data."""
        body = self._get(token, "/v1/query/span")
        first, last = body["rows"][0] if body["rows"] else (None, None)
        return None if first is None or last is None else (float(first), float(last))

    def months(self, token: str) -> list[dict[str, Any]]:
        """Months the ledger has data for (admin)."""
        body: list[dict[str, Any]] = self._get(token, "/v1/months")
        return body

    def keys(self, token: str, revoked: bool = False) -> list[dict[str, Any]]:
        """The keys this token manages (the admin every one, a lead its team's); no secrets."""
        body = self._get(token, "/v1/keys", {"revoked": "true" if revoked else "false"})
        found: list[dict[str, Any]] = body["keys"]
        return found

    def issue_key(self, token: str, request: dict[str, Any]) -> dict[str, Any]:
        """Issue a key (``POST /v1/keys``); the answer's ``key`` is its secret, shown this once."""
        found: dict[str, Any] = self._send(token, "/v1/keys", body=request).json()
        return found

    def change_key(
        self, token: str, key_id: str, action: Literal["revoke", "rotate"], reason: str
    ) -> dict[str, Any]:
        """Revoke or rotate key ``key_id``; a rotation's answer carries the new secret."""
        path = f"/v1/keys/{key_id}/{action}"
        found: dict[str, Any] = self._send(token, path, body={"reason": reason}).json()
        return found

    def export(
        self, token: str, month: str, kind: Literal["csv", "focus"], focus_version: str = "1.0"
    ) -> Download:
        """A month's chargeback CSV or FOCUS file, as billing writes it for this token.

        The admin gets every line, a team its own. Billing computes the statement afresh for a
        file, hence the long timeout.
        """
        if kind == "csv":
            path, params = f"/v1/chargeback/{month}.csv", None
        else:
            path, params = f"/v1/chargeback/{month}.focus.csv", {"version": focus_version}
        response = self._send(token, path, params, STATEMENT_TIMEOUT_SECONDS)
        found = _FILENAME.search(response.headers.get("content-disposition", ""))
        filename = found.group(1) if found else path.rsplit("/", 1)[-1]
        return Download(response.text, filename)
