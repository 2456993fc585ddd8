"""What a sidecar knows about its replica, teams and models, swappable on reload.

Everything a reload may change (keys, limits, the model registry) lives in one frozen ``View``
built from the configuration; a reload builds a new one and swaps it in with one assignment, so
a request in flight keeps the view it started with. A newer set of keys issued at run time
(``sidecar.keysync``) is swapped in the same way (``with_issued``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Final

from infermeter.auth import ADMIN, METRICS, GatewayVerifier, KeyRing
from infermeter.config import Config, Replica, env_value
from infermeter.keys import IssuedKeys
from sidecar.bounds import shown
from sidecar.prefix import PrefixDigester, prefix_digester
from sidecar.tags import ProjectRule, project_rules

__all__ = [
    "MAX_LISTED",
    "ModelNotFoundError",
    "Route",
    "View",
    "build_view",
    "not_found_message",
]

# A 404 names at most this many models, each capped like any echoed name, so it stays short.
MAX_LISTED: Final = 8


class ModelNotFoundError(Exception):
    """The requested model or version is not approved for this replica."""


@dataclass(frozen=True)
class Route:
    """Where a request for a model name goes on this replica."""

    model: str
    served_version: str


@dataclass(frozen=True)
class View:
    """The reloadable part of a sidecar's configuration."""

    replica: Replica
    model: str
    served_version: str
    approved: frozenset[str]
    keys: KeyRing
    control: KeyRing
    control_open: bool
    gateway: GatewayVerifier | None
    prefix: PrefixDigester | None = None
    # Each team's allowed project tags (``sidecar.tags``).
    projects: Mapping[str, ProjectRule] = field(default_factory=dict)

    # The properties below are read by every request and constant for the view: computed once
    # (a reload builds a new view).

    @cached_property
    def model_names(self) -> frozenset[str]:
        """Every model name a metric label may carry: the alias and its approved versions."""
        return self.approved | {self.model, self.served_version}

    @cached_property
    def available(self) -> tuple[str, ...]:
        """The names a client may ask for now: the alias first, then the approved versions.

        None while the replica's own version is not approved (rolled back): nothing is served.
        """
        if self.served_version not in self.approved:
            return ()
        return (self.model, *sorted(self.approved))

    def route(self, requested: str | None) -> Route:
        """Map a requested name (model alias or approved version) to this replica's version.

        Only approved versions are served: when the replica's own version is no longer approved
        (rolled back), every request is refused. A request naming another approved version is
        served by the version this replica runs: every approved version may stand for the alias.
        """
        available = self.available
        if available and (requested is None or requested in available):
            return self._route
        raise ModelNotFoundError(not_found_message(requested, available))

    def with_issued(self, issued: IssuedKeys) -> View:
        """This view with ``issued`` as the run-time keys beside the configured ones."""
        return replace(self, keys=self.keys.with_issued(issued))

    @cached_property
    def _route(self) -> Route:
        return Route(self.model, self.served_version)


def not_found_message(requested: str | None, available: tuple[str, ...]) -> str:
    """OpenAI's 404 sentence, then the names that do exist here (bounded: the names are configured)."""
    head = f"The model `{shown(requested)}` does not exist or you do not have access to it."
    if not available:
        return f"{head} This replica serves no approved version right now."
    names = ", ".join(f"`{shown(n)}`" for n in available[:MAX_LISTED])
    more = f" and {len(available) - MAX_LISTED} more" if len(available) > MAX_LISTED else ""
    return f"{head} Available models: {names}{more}."


def build_view(config: Config, replica_id: str, issued: IssuedKeys | None = None) -> View:
    """The view of ``replica_id``; KeyError if the replica is not configured.

    ``issued``: the team keys issued at run time (``sidecar.keysync``), taken beside the
    configured ones; a reload keeps the set the sidecar holds.

    In gateway mode a signature names the model it is for: this replica's (the audience). The
    memory of nonces served is the sidecar's, not the view's (``sidecar.nonces``): a reload
    does not forget it.
    """
    replica = config.replica(replica_id)
    model = config.model(replica.model)
    gateway = None
    g = config.sidecar.gateway
    if g.enabled:
        secret = env_value(g.secret_env) or ""
        if not secret:
            raise ValueError(f"sidecar.gateway is enabled but ${g.secret_env} is empty")
        gateway = GatewayVerifier(
            secret.encode(),
            g.team_header,
            g.timestamp_header,
            g.signature_header,
            g.max_skew_seconds,
            frozenset(t.name for t in config.teams),
            model.name,
            g.nonce_header,
        )
    control_digests = [*config.admin_token_sha256, *config.metrics_token_sha256]
    return View(
        replica=replica,
        model=model.name,
        served_version=replica.served_version or model.current_version,
        approved=frozenset(model.approved_versions),
        keys=KeyRing(((t.name, t.api_key_sha256) for t in config.teams), issued),
        # The control endpoints (/metrics) are for the scrapers: the admin and metrics roles.
        control=KeyRing(
            [(ADMIN, config.admin_token_sha256), (METRICS, config.metrics_token_sha256)]
        ),
        control_open=not control_digests,
        gateway=gateway,
        prefix=prefix_digester(
            env_value(config.sidecar.prefix_key_env), config.sidecar.prefix_digest_chars
        ),
        projects=project_rules(config),
    )
