"""Alerts that fired in a range, read from Prometheus's HTTP API, as events for the charts.

Prometheus keeps every alert's state as the series ``ALERTS{alertname, alertstate, ...}``: while
an alert fires, its ``alertstate="firing"`` series has a sample at every evaluation. A range
query of those series, at a step fine enough for the range, gives each alert's firing runs; an
alert *fired* at the start of each run (as the step sees it: at most one step after it did). Why it fired is its rule's ``summary`` annotation: as
Prometheus expanded it when the alert is still active (``/api/v1/alerts``), else the rule's
template (``/api/v1/rules``) with the alert's labels filled in and its value, which the series
does not keep, left out.

``alert_events`` is pure over the three answers; ``fired_alerts`` asks Prometheus for them.
A Prometheus that does not answer costs the charts their alert markers and one sentence, never
the page.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, Final

import httpx

__all__ = ["MAX_POINTS", "alert_events", "fired_alerts", "step_for"]

# Points per series a range query asks for: well under Prometheus's limit of 11,000.
MAX_POINTS: Final = 5000
_LABEL = re.compile(r"\{\{\s*\$labels\.(\w+)\s*\}\}")
_VALUE = re.compile(r"\{\{[^}]*\$value[^}]*\}\}")
_SHOWN_LABELS: Final = ("model", "team", "replica", "instance", "node", "severity")


def step_for(start: float, end: float) -> int:
    """Seconds between points: at least 15 (a usual evaluation interval), at most MAX_POINTS."""
    return max(15, math.ceil((end - start) / MAX_POINTS))


def _identity(labels: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in labels.items() if k not in ("__name__", "alertstate")))


def _summary(template: str, labels: Mapping[str, str]) -> str:
    filled = _LABEL.sub(lambda m: labels.get(m.group(1), m.group(0)), template)
    return re.sub(r"\s+", " ", _VALUE.sub("(value not kept)", filled)).strip()


def alert_events(
    series: Sequence[Mapping[str, Any]],
    rules: Sequence[Mapping[str, Any]],
    active: Sequence[Mapping[str, Any]],
    step: int,
) -> list[dict[str, Any]]:
    """One event per firing run of each ``ALERTS`` series (a range query's ``result``).

    ``rules``: alerting rules (name, annotations), ``active``: the alerts active now (labels,
    annotations), both as Prometheus answers them. Samples more than 1.5 steps apart start a
    new run.
    """
    templates = {r["name"]: (r.get("annotations") or {}).get("summary", "") for r in rules}
    expanded = {
        _identity(a["labels"]): (a.get("annotations") or {}).get("summary", "") for a in active
    }
    events = []
    for item in series:
        labels: Mapping[str, str] = item["metric"]
        name = labels.get("alertname", "alert")
        times = sorted(float(t) for t, _ in item.get("values", []))
        shown = ", ".join(f"{k} {labels[k]}" for k in _SHOWN_LABELS if k in labels)
        why = expanded.get(_identity(labels)) or _summary(templates.get(name, ""), labels)
        for i, t in enumerate(times):
            if i and t - times[i - 1] <= 1.5 * step:
                continue
            events.append(
                {
                    "at": t,
                    "kind": "alert",
                    "model": labels.get("model"),
                    "title": f"{name} fired" + (f" ({shown})" if shown else ""),
                    "detail": why or "(the rule has no summary)",
                }
            )
    return sorted(events, key=lambda e: (e["at"], e["title"]))


def _data(client: httpx.Client, path: str, params: Mapping[str, Any] | None = None) -> Any:
    response = client.get(path, params=params)
    response.raise_for_status()
    body = response.json()
    if body.get("status") != "success":
        raise ValueError(f"Prometheus answered {body.get('error') or body.get('status')}")
    return body["data"]


def fired_alerts(
    url: str, start: float, end: float, timeout_seconds: float = 3.0
) -> tuple[list[dict[str, Any]], str | None]:
    """The alerts that fired in ``start``..``end``, and a sentence when Prometheus failed us."""
    step = step_for(start, end)
    # Points are start, start + step, ...: counted back from ``end``, the last one is ``end``
    # itself, so an alert that began firing within the last step is not missed.
    first = end - math.ceil((end - start) / step) * step
    query = {"query": 'ALERTS{alertstate="firing"}', "start": first, "end": end, "step": step}
    try:
        with httpx.Client(base_url=url.rstrip("/"), timeout=timeout_seconds) as client:
            series = _data(client, "/api/v1/query_range", query)["result"]
            groups = _data(client, "/api/v1/rules", {"type": "alert"})["groups"]
            active = _data(client, "/api/v1/alerts")["alerts"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        return [], f"Alerts are not marked: Prometheus at {url} did not answer ({exc})."
    rules = [r for g in groups for r in g.get("rules", [])]
    return alert_events(series, rules, active, step), None
