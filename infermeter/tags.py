"""The rules a request's project tag and end user must follow, wherever they are checked.

The sidecar refuses a request that breaks them (``sidecar.tags``) and billing quarantines a
usage record that breaks them (``billing.trust_sql``): a writer's credential in the wrong hands
must not open rows of a statement the team never allowed. One definition serves both, so the
two can never disagree on what a tag may be: the team's ``project_pattern`` is a Python regular
expression, judged here by Python, never translated to another dialect.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from infermeter.config import Config, Team

__all__ = [
    "MAX_PROJECT_CHARS",
    "MAX_USER_CHARS",
    "ProjectRule",
    "project_allowed",
    "project_rules",
    "user_allowed",
]

# OpenAI documents no limit; 128 characters holds a UUID, an e-mail address or a hashed id,
# and bounds what a record (and a statement row) carries.
MAX_USER_CHARS: Final = 128
# A configured name's bound (``infermeter.config.Name``), held by tags a pattern allows too.
MAX_PROJECT_CHARS: Final = 128


@dataclass(frozen=True, slots=True)
class ProjectRule:
    """The project tags one team allows: a list, and a pattern a tag must match whole."""

    allowed: frozenset[str]
    pattern: re.Pattern[str] | None

    def allows(self, project: str) -> bool:
        """Whether ``project`` is listed or matches the pattern whole."""
        if project in self.allowed:
            return True
        return self.pattern is not None and self.pattern.fullmatch(project) is not None


def _rule(team: Team) -> ProjectRule:
    pattern = re.compile(team.project_pattern) if team.project_pattern is not None else None
    return ProjectRule(frozenset(team.projects), pattern)


def project_rules(config: Config) -> dict[str, ProjectRule]:
    """Each team's project rule, compiled once per configuration (a reload builds new ones)."""
    return {t.name: _rule(t) for t in config.teams}


def project_allowed(rules: Mapping[str, ProjectRule], team: str, project: str) -> bool:
    """Whether ``team`` may carry ``project``: a team unknown to ``rules`` allows none."""
    rule = rules.get(team)
    return len(project) <= MAX_PROJECT_CHARS and rule is not None and rule.allows(project)


def user_allowed(user: str) -> bool:
    """Whether ``user`` is 1 to ``MAX_USER_CHARS`` printable characters."""
    return 0 < len(user) <= MAX_USER_CHARS and user.isprintable()
