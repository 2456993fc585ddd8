"""Attribution below the team: the project a request is for and the end user it names.

A request may carry ``X-Infermeter-Project: <tag>`` and, in its JSON body, OpenAI's ``user``
field (passed on to vLLM as sent). Both end up on its usage record, so billing can break a
team's line down by project and user (``billing.breakdown``); neither is ever a metric label,
since a team may have many. Both are checked before anything is forwarded: a project the
calling team does not allow, or a user that is not a short printable string, is an OpenAI-style
400 naming the header or the field. Pure functions over the head, the parsed body and the
configured rules (``infermeter.tags``, which billing applies to the records too); the body is
the one the admission already parsed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from infermeter.tags import (
    MAX_PROJECT_CHARS,
    MAX_USER_CHARS,
    ProjectRule,
    project_allowed,
    project_rules,
    user_allowed,
)
from sidecar.bounds import shown

__all__ = [
    "MAX_PROJECT_CHARS",
    "MAX_USER_CHARS",
    "PROJECT_HEADER",
    "ProjectRule",
    "TagRefusal",
    "project_of",
    "project_rules",
    "user_of",
]

# A constant, not a setting: clients and gateways are written against one name, and the
# sidecar's own ``x-infermeter-*`` headers never reach vLLM (``sidecar.admission``).
PROJECT_HEADER: Final = "X-Infermeter-Project"
_HEADER_KEY: Final = PROJECT_HEADER.lower().encode()


class TagRefusal(Exception):
    """A project or user the request may not carry: the 400 message and the ``param`` it names."""

    def __init__(self, message: str, param: str, code: str) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


def project_of(
    rules: Mapping[str, ProjectRule], team: str, headers: Sequence[tuple[bytes, bytes]]
) -> str | None:
    """The project ``headers`` name for ``team``'s request, None without one; TagRefusal when
    the team does not allow it (or uses no projects)."""
    value = None
    for key, raw in headers:
        if key == _HEADER_KEY:
            value = raw.decode("latin-1")
            break
    if value is None:
        return None
    if not project_allowed(rules, team, value):
        raise TagRefusal(
            f"Project `{shown(value)}` is not a project of team {team}: "
            f"send one its configuration allows, or no {PROJECT_HEADER} header.",
            PROJECT_HEADER,
            "invalid_project",
        )
    return value


def user_of(body: Mapping[str, Any]) -> str | None:
    """The end user the request body names (OpenAI's ``user``), None without one; TagRefusal
    for anything but a string of 1 to ``MAX_USER_CHARS`` printable characters."""
    user = body.get("user")
    if user is None:
        return None
    if not isinstance(user, str) or not user_allowed(user):
        raise TagRefusal(
            f"'user' must be a string of 1 to {MAX_USER_CHARS} printable characters.",
            "user",
            "invalid_user",
        )
    return user
