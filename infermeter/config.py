"""One typed configuration for every infermeter process.

The YAML file is parsed once, at start, into frozen pydantic models and passed down; nothing
below the command line reads files or the environment for settings. Every model forbids unknown
keys, so a typo fails at start instead of silently falling back to a default.

Environment overrides: a variable ``INFERMETER__<PATH>`` replaces one value of the file before
validation. ``<PATH>`` is the key path joined by double underscores, case-insensitive; list
entries are addressed by their ``name`` (teams, models, nodes) or ``id`` (replicas), or by index:

    INFERMETER__PRICES__USD_PER_KWH=0.21
    INFERMETER__TEAMS__SEARCH__BUDGET_USD_PER_MONTH=12000
    INFERMETER__REPLICAS__LARGE_0__UPSTREAM_URL=http://10.0.0.7:8000

Values are read as YAML scalars (``0.21`` is a number, ``true`` a boolean). ``INFERMETER_CONFIG``
names the file when ``--config`` is not given.
"""

from __future__ import annotations

import difflib
import hashlib
import os
import re
from collections.abc import Mapping
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Final, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)

__all__ = [
    "CACHED_PROMPT_SHARE",
    "ENV_PREFIX",
    "HASH_HINT",
    "AlertSettings",
    "AutoscaleSettings",
    "BillingSettings",
    "CollectorSettings",
    "Config",
    "ConfigError",
    "DashboardSettings",
    "GatewaySettings",
    "GpuProfile",
    "KubernetesDiscovery",
    "KubernetesHookSettings",
    "Model",
    "ModelArchitecture",
    "Node",
    "NodePool",
    "OidcSettings",
    "PoolPrice",
    "Prices",
    "PricingCategory",
    "RegistryDiscovery",
    "Replica",
    "ScalingPolicy",
    "SidecarSettings",
    "Sla",
    "SlaOverride",
    "Team",
    "TeamLimits",
    "TokenWeights",
    "credential_hashes",
    "default_config_path",
    "hash_key",
    "load_config",
    "shared_credentials",
]

ENV_PREFIX = "INFERMETER__"
DEFAULT_CONFIG = Path(__file__).with_name("defaults.yaml")
# libyaml's parser under PyYAML's safe constructor (the same types, tags refused alike), when the
# installed PyYAML was built with it: a fleet's file with 1,000 teams is read in 73 ms instead of
# 370 (``bench.config_load``, docs/benchmarks.md).
_BASE_LOADER: type[yaml.SafeLoader] | type[yaml.CSafeLoader] = getattr(
    yaml, "CSafeLoader", yaml.SafeLoader
)
_MERGE_TAG = "tag:yaml.org,2002:merge"


class _Loader(_BASE_LOADER):  # type: ignore[valid-type,misc]
    """The safe loader, refusing a key given twice in one mapping: YAML keeps the last of them
    silently, so a second ``billing:`` section appended to a file would replace the first
    whole (its tokens and URLs gone) without a word."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:
                continue  # keys merged in (<<) may be given again: that is what merging is for
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, str | int | float | bool) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"duplicate key {key!r} (first given on line {seen[key] + 1})",
                    key_node.start_mark,
                )
            if isinstance(key, str | int | float | bool):
                seen[key] = key_node.start_mark.line
        mapping: dict[Any, Any] = super().construct_mapping(node, deep=deep)
        return mapping


_YAML_LOADER = _Loader

Name = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")]
HASH_HINT = (
    "not a SHA-256 hex digest: put here the 64 hex digits that "
    '`printf %s "$KEY" | sha256sum` prints for the key'
)
_HEX64 = re.compile(r"[0-9a-f]{64}")


def _digest(value: object) -> object:
    """Accept a lowercase SHA-256 hex digest; anything else (a placeholder) says what to put."""
    if isinstance(value, str) and _HEX64.fullmatch(value):
        return value
    raise ValueError(HASH_HINT)


Sha256 = Annotated[str, BeforeValidator(_digest)]
NonNegative = Annotated[float, Field(ge=0)]
Positive = Annotated[float, Field(gt=0)]


def hash_key(key: str) -> str:
    """SHA-256 hex digest of an API key: the only form in which a key is ever stored."""
    return hashlib.sha256(key.encode()).hexdigest()


class ConfigError(Exception):
    """A configuration file that cannot be used, with where and why.

    The message is one line per problem, ``file: key.path = value: reason``, so an operator can
    fix the file without reading a traceback. A problem with a value an environment variable
    set names that variable instead of the file (``sources``, one per problem), since the file
    is not where the operator would fix it.
    """

    def __init__(self, source: str, problems: list[str], sources: list[str] | None = None) -> None:
        self.source = source
        self.problems = problems
        self.sources = sources or [source] * len(problems)
        super().__init__(
            "\n".join(f"{where}: {p}" for where, p in zip(self.sources, problems, strict=True))
        )


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class TeamLimits(_Strict):
    """Per-team admission limits applied by every sidecar; ``None`` means unlimited."""

    requests_per_minute: Annotated[int, Field(gt=0)] | None = None
    tokens_per_minute: Annotated[int, Field(gt=0)] | None = None
    max_concurrent: Annotated[int, Field(gt=0)] | None = None


class Team(_Strict):
    """An internal team that is charged for what its requests use."""

    name: Name
    api_key_sha256: list[Sha256] = Field(default_factory=list)
    budget_usd_per_month: NonNegative = 0.0
    limits: TeamLimits = TeamLimits()
    priority: int = 0
    # Whether the team's work can wait for off-peak hours (the efficiency advisor's off-peak
    # advice): "auto" judges it from the share of its requests that were not streamed.
    workload: Literal["auto", "interactive", "batch"] = "auto"
    # Attribution below the team: the project tags a request may carry (the sidecar's
    # ``X-Infermeter-Project`` header), listed or matched whole by ``project_pattern``. With
    # neither, the team does not use projects and a request naming one is refused.
    projects: list[Name] = Field(default_factory=list)
    project_pattern: str | None = None
    project_budgets_usd_per_month: dict[Name, NonNegative] = Field(default_factory=dict)
    # How many distinct end users (OpenAI's ``user`` field) billing breaks out per team and
    # month, by spend; the rest are shown together as "(other users)", so a team that puts a
    # fresh id on every request cannot make a statement unbounded.
    max_users: Annotated[int, Field(gt=0)] = 1000

    @field_validator("project_pattern")
    @classmethod
    def _pattern_compiles(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"not a regular expression: {exc}") from None
        return value

    @model_validator(mode="after")
    def _budgets_name_allowed_projects(self) -> Team:
        unknown = [p for p in self.project_budgets_usd_per_month if not self.allows_project(p)]
        if unknown:
            raise ValueError(
                f"project_budgets_usd_per_month names projects the team does not allow: {unknown} "
                "(list them in projects or match them with project_pattern)"
            )
        return self

    def allows_project(self, project: str) -> bool:
        """Whether a request of this team may carry ``project``: listed, or matched whole."""
        if project in self.projects:
            return True
        return (
            self.project_pattern is not None
            and re.fullmatch(self.project_pattern, project) is not None
        )


class Sla(_Strict):
    """Latency and speed targets of one use case; checked by alerts and dashboards."""

    ttft_p95_seconds: Positive = 2.0
    min_output_tokens_per_second: NonNegative = 0.0
    max_error_ratio: Annotated[float, Field(ge=0, le=1)] = 0.01


class ModelArchitecture(_Strict):
    """A model's size and attention shape, as its ``config.json`` states them.

    What the efficiency advisor sizes memory by (weights and KV cache at another precision, on
    fewer GPUs); without it a model gets no memory-based advice, never a shape guessed from its
    name.
    """

    params_billions: Positive
    layers: Annotated[int, Field(gt=0)]
    kv_heads: Annotated[int, Field(gt=0)]
    head_dim: Annotated[int, Field(gt=0)]
    precision: Literal["bf16", "fp16", "fp8", "int8", "int4"] = "bf16"  # of the served weights


class Model(_Strict):
    """A model name clients ask for, and the served versions that are approved for it."""

    name: Name
    approved_versions: list[Name]
    serve_version: Name | None = None
    use_case: Name = "interactive"
    sla: Sla = Sla()
    max_model_len: Annotated[int, Field(gt=0)] = 8192
    architecture: ModelArchitecture | None = None

    @model_validator(mode="after")
    def _serve_version_is_approved(self) -> Model:
        if not self.approved_versions:
            raise ValueError("approved_versions must list at least one served model version")
        if self.serve_version is not None and self.serve_version not in self.approved_versions:
            raise ValueError(
                f"serve_version {self.serve_version!r} is not in approved_versions "
                f"{self.approved_versions}"
            )
        return self

    @property
    def current_version(self) -> str:
        """The served version requests for this model are routed to."""
        return self.serve_version or self.approved_versions[0]


Url = Annotated[str, StringConstraints(pattern=r"^https?://[^/\s]+(/\S*)?$")]
RedisUrl = Annotated[str, StringConstraints(pattern=r"^(rediss?|unix)://\S+$")]


def listen_address(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) as the servers bind it; ValueError saying what
    is expected otherwise (a port out of range would fail only when the server starts)."""
    host, sep, port = value.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or any(c.isspace() or c in "/[]" for c in host):
        raise ValueError("not HOST:PORT (such as 127.0.0.1:8080 or [::1]:8080)")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError("the port must be a number from 1 to 65535")
    return host, int(port)


def _listen(value: str) -> str:
    listen_address(value)
    return value


Listen = Annotated[str, AfterValidator(_listen)]


class Replica(_Strict):
    """One vLLM engine: where it listens, what it serves, and which GPUs it owns."""

    id: Name
    model: Name
    upstream_url: Url
    sidecar_listen: Listen | None = None
    # Where the collector reads vLLM's /metrics. When vLLM listens on loopback only (it should:
    # vLLM serves some routes without its API key), that is the sidecar's /engine/metrics.
    engine_metrics_url: Url | None = None
    served_version: Name | None = None
    node: Name
    gpu_model: Name
    gpu_count: Annotated[int, Field(gt=0)] = 1
    gpus: list[int | str] = Field(default_factory=list)
    max_num_seqs: Annotated[int, Field(gt=0)] | None = None
    idle_policy: Literal["spread", "platform", "owner"] = "spread"
    owner_team: Name | None = None

    @property
    def engine_metrics(self) -> str:
        """The URL of vLLM's metrics page: ``engine_metrics_url``, else ``<upstream_url>/metrics``."""
        return self.engine_metrics_url or self.upstream_url.rstrip("/") + "/metrics"

    @model_validator(mode="after")
    def _check(self) -> Replica:
        if self.gpus and len(self.gpus) != self.gpu_count:
            raise ValueError(f"gpus lists {len(self.gpus)} GPUs but gpu_count is {self.gpu_count}")
        if self.idle_policy == "owner" and self.owner_team is None:
            raise ValueError("idle_policy 'owner' needs owner_team")
        return self


class Node(_Strict):
    """A GPU host; ``dcgm_exporter_url`` is scraped by the collector when set."""

    name: Name
    dcgm_exporter_url: Url | None = None
    gpu_model: Name | None = None
    gpu_count: Annotated[int, Field(ge=0)] = 0


PricingCategory = Literal["on_demand", "committed", "spot", "owned"]


def _utc_hour(value: object) -> object:
    """An ISO date or UTC date-time, as epoch seconds on a whole hour.

    Prices change on a whole hour, as cloud providers bill: the ledger keeps its cost rows per
    hour (``billing.hourly``) and prices each at the rate in effect in it. A time zone other
    than UTC, or minutes within the hour, would make the split ambiguous, so both are refused.
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        t = float(value)
    elif isinstance(value, str):
        text = value.strip().replace("Z", "+00:00")
        try:
            parsed = datetime.fromisoformat(text)
        except ValueError:
            raise ValueError(f"{value!r} is not an ISO date or date-time") from None
        if parsed.tzinfo is None:
            parsed = parsed.replace(tzinfo=UTC)
        elif parsed.utcoffset() != timedelta(0):
            raise ValueError(f"{value!r}: give the time in UTC (Z or +00:00)")
        t = parsed.timestamp()
    elif isinstance(value, date):  # YAML reads an unquoted 2026-11-15 as a date
        return _utc_hour(value.isoformat())
    else:
        raise ValueError(f"{value!r} is not an ISO date or date-time")
    if t % 3600:
        raise ValueError(f"{value!r}: prices change on a whole hour (UTC), like a cloud bill")
    return t


UtcHour = Annotated[float, BeforeValidator(_utc_hour)]


class PoolPrice(_Strict):
    """One dated entry of a node pool's price: in effect from ``from_`` until the next entry.

    ``on_demand`` and ``spot`` are a GPU-hour rate. ``committed`` is a rate and the GPUs paid
    for at it whether used or not (``committed_gpus``). ``owned`` is hardware bought: its rate
    is worked out from the purchase (``billing.pricebook.owned_rate``), and its power is billed
    as measured like any GPU's. ``usd_per_kwh`` (and ``pue``) replace the price book's energy
    price for this pool: 0 for a cloud pool, whose GPU rate includes power.
    """

    from_: Annotated[UtcHour, Field(alias="from")]
    category: PricingCategory = "on_demand"
    usd_per_gpu_hour: NonNegative | None = None
    committed_gpus: Annotated[int, Field(gt=0, le=100_000)] | None = None
    purchase_usd_per_gpu: NonNegative | None = None
    depreciation_months: Annotated[int, Field(gt=0, le=240)] | None = None
    salvage_usd_per_gpu: NonNegative = 0.0
    hosting_usd_per_gpu_month: NonNegative = 0.0
    usd_per_kwh: NonNegative | None = None
    pue: Annotated[float, Field(ge=1.0, le=3.0)] | None = None
    sku: Annotated[str, StringConstraints(max_length=128)] | None = None

    model_config = ConfigDict(
        extra="forbid", frozen=True, populate_by_name=True, allow_inf_nan=False
    )

    @model_validator(mode="after")
    def _complete(self) -> PoolPrice:
        if self.category == "owned":
            if self.purchase_usd_per_gpu is None or self.depreciation_months is None:
                raise ValueError(
                    "an owned entry needs purchase_usd_per_gpu and depreciation_months"
                )
            if self.salvage_usd_per_gpu > self.purchase_usd_per_gpu:
                raise ValueError("salvage_usd_per_gpu is more than purchase_usd_per_gpu")
            if self.usd_per_gpu_hour is not None or self.committed_gpus is not None:
                raise ValueError(
                    "an owned entry's rate comes from its purchase: drop usd_per_gpu_hour / committed_gpus"
                )
        else:
            if self.usd_per_gpu_hour is None:
                raise ValueError(f"a {self.category} entry needs usd_per_gpu_hour")
            if (self.category == "committed") != (self.committed_gpus is not None):
                raise ValueError("committed_gpus is given with, and only with, category committed")
            if self.purchase_usd_per_gpu is not None or self.depreciation_months is not None:
                raise ValueError(
                    f"purchase and depreciation are for owned entries, not {self.category}"
                )
        return self


class NodePool(_Strict):
    """A set of nodes priced together: by name (``nodes``) or a glob on the name (``node_pattern``).

    A node belongs to the first pool that names it or matches it, in the order pools are
    listed; a node in no pool is priced by its GPU model (``usd_per_gpu_hour``) as on-demand.
    ``resource_ids`` and ``invoice_tags`` say which line items of a cloud invoice bill this
    pool (``billing.invoices``): an item whose ResourceId is listed, or whose Tags hold every
    pair given.
    """

    name: Name
    nodes: Annotated[list[Name], Field(max_length=10_000)] = Field(default_factory=list)
    node_pattern: Annotated[str, StringConstraints(min_length=1, max_length=256)] | None = None
    prices: Annotated[list[PoolPrice], Field(min_length=1, max_length=1000)]
    resource_ids: Annotated[
        list[Annotated[str, StringConstraints(min_length=1, max_length=1024)]],
        Field(max_length=10_000),
    ] = Field(default_factory=list)
    invoice_tags: dict[
        Annotated[str, StringConstraints(min_length=1, max_length=256)],
        Annotated[str, StringConstraints(max_length=256)],
    ] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _valid(self) -> NodePool:
        if not self.nodes and self.node_pattern is None:
            raise ValueError(f"pool {self.name!r} names no nodes: give nodes or node_pattern")
        starts = [p.from_ for p in self.prices]
        if starts != sorted(starts) or len(set(starts)) != len(starts):
            raise ValueError(
                f"pool {self.name!r}: prices must be listed by strictly increasing from"
            )
        return self


class Prices(_Strict):
    """The price book: GPU time by GPU model, plus energy, and dated prices per node pool."""

    usd_per_gpu_hour: dict[Name, NonNegative]
    usd_per_kwh: NonNegative = 0.0
    pue: Annotated[float, Field(ge=1.0, le=3.0)] = 1.0
    currency: Literal["USD"] = "USD"
    pools: Annotated[list[NodePool], Field(max_length=1000)] = Field(default_factory=list)

    @field_validator("pools")
    @classmethod
    def _unique_pools(cls, pools: list[NodePool]) -> list[NodePool]:
        names = [p.name for p in pools]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"duplicate pool {dup[0]!r}")
        return pools


class ScalingPolicy(_Strict):
    """Autoscaling defaults; see alerts/ for how each is used."""

    min_replicas: Annotated[int, Field(ge=0)] = 2
    max_replicas: Annotated[int, Field(gt=0)] | None = None
    scale_up_queue_depth: Annotated[int, Field(ge=0)] = 10
    scale_up_after_seconds: Positive = 30
    # The most replicas one tick of the sustained-queue rule adds; None: max(replicas serving,
    # 4), an HPA's default scale-up policy. At most 10,000, the most a decision may ask for.
    max_scale_up_step: Annotated[int, Field(gt=0, le=10_000)] | None = None
    scale_down_gpu_utilization: Annotated[float, Field(ge=0, le=1)] = 0.30
    scale_down_after_seconds: Positive = 300
    cooldown_seconds: NonNegative = 180
    startup_seconds: NonNegative = 180
    monthly_budget_cap_usd: NonNegative | None = None

    @model_validator(mode="after")
    def _bounds_in_order(self) -> ScalingPolicy:
        if self.max_replicas is not None and self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas {self.min_replicas} is above max_replicas {self.max_replicas}"
            )
        return self


class GpuProfile(_Strict):
    """Electrical and memory facts of a GPU model, used by the simulator's power model."""

    idle_watts: Positive
    max_watts: Positive
    memory_mib: Annotated[int, Field(gt=0)]
    product_name: str

    @model_validator(mode="after")
    def _idle_below_max(self) -> GpuProfile:
        if self.idle_watts >= self.max_watts:
            raise ValueError("idle_watts must be below max_watts")
        return self


class EngineProfile(_Strict):
    """Continuous-batching timing of a simulated vLLM engine.

    One engine step decodes one token for every running sequence and prefills newly admitted
    prompts; it lasts ``step_base_ms + step_per_seq_ms * running + prefill_tokens / prefill_rate``.
    """

    max_num_seqs: Annotated[int, Field(gt=0)] = 64
    kv_cache_tokens: Annotated[int, Field(gt=0)] = 200_000
    block_size: Annotated[int, Field(gt=0)] = 16
    step_base_ms: Positive = 12.0
    step_per_seq_ms: NonNegative = 0.25
    prefill_tokens_per_second: Positive = 20_000.0
    mean_output_tokens: Positive = 180.0


class GatewaySettings(_Strict):
    """Trusted-gateway mode: an upstream gateway names the team in a signed header.

    The shared secret comes from the environment variable named by ``secret_env``, never from
    the file, so the file can be committed.
    """

    enabled: bool = False
    team_header: str = "x-infermeter-team"
    timestamp_header: str = "x-infermeter-timestamp"
    signature_header: str = "x-infermeter-signature"
    nonce_header: str = "x-infermeter-nonce"
    max_skew_seconds: Positive = 300
    # Nonces seen within the skew window are remembered to refuse replays; past this many, the
    # oldest are forgotten and signatures no newer than them are refused as stale.
    replay_cache_entries: Annotated[int, Field(gt=0)] = 100_000
    secret_env: str = "INFERMETER_GATEWAY_SECRET"


class SharedLimitsSettings(_Strict):
    """Team limits held fleet-wide in Redis; without ``redis_url`` each sidecar keeps its own."""

    redis_url: RedisUrl | None = None
    # The Redis password (AUTH) is read from this variable, never written in the URL.
    password_env: str = "INFERMETER_REDIS_PASSWORD"
    key_prefix: str = "infermeter"
    # "team": one set of limits per team for the whole fleet; "team_replica": one per replica
    # group (model group), so a team's limit applies to each model it calls.
    scope: Literal["team", "team_replica"] = "team"
    # Redis unreachable or slower than timeout_millis: each sidecar serves limit / live instances
    # (fail_open), or refuses with 503 and Retry-After (fail_closed).
    on_failure: Literal["fail_open", "fail_closed"] = "fail_open"
    timeout_millis: Annotated[int, Field(gt=0)] = 100
    # After a failure, Redis is tried again this often; requests meanwhile follow on_failure.
    retry_seconds: Positive = 1.0
    # A concurrency slot not renewed for this long is free again (a sidecar killed holding it).
    lease_seconds: Positive = 30.0
    # Billing's instance registry, for the number of live instances sharing a limit in fail_open.
    registry_url: Url | None = None
    registry_token_env: str = "INFERMETER_REGISTRY_TOKEN"
    instances_refresh_seconds: Positive = 30.0
    # Billing's public key for the issued keys' set it writes here (``infermeter keys signer``
    # prints it). Unset, each sidecar learns it from billing's own answer, so a sidecar started
    # for the first time while billing is down takes no set from Redis until billing answers;
    # set, it checks the set against this key from its start, and no other.
    key_signer: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")] | None = None


class BudgetSettings(_Strict):
    """Budgets enforced by the sidecars from billing's month-to-date spend (``GET /v1/spend``)."""

    spend_url: Url | None = None
    spend_token_env: str = "INFERMETER_SPEND_TOKEN"
    refresh_seconds: Annotated[float, Field(gt=0, le=60)] = 30.0
    # Past this share of the monthly budget, responses carry x-infermeter-budget-warning.
    soft_share: Annotated[float, Field(gt=0, le=1)] = 0.8
    # Past the whole budget: refuse every request (429 budget_exceeded), only requests for
    # models not in priority_models, or none (warn only).
    on_exceeded: Literal["refuse", "refuse_non_priority", "warn"] = "refuse"
    priority_models: list[str] = Field(default_factory=list)


class SidecarSettings(_Strict):
    """How every sidecar relays, limits and meters."""

    spool_dir: str = "var/spool"
    ingest_url: Url | None = None
    # The instance's own writer credential (``infermeter.writers``): it seals the spool lines and
    # ships them. Unset: the shared ingest token in ingest_token_env, if billing still takes it.
    credential_env: str = "INFERMETER_WRITER_CREDENTIAL"
    ingest_token_env: str = "INFERMETER_INGEST_TOKEN"
    upstream_api_key_env: str = "INFERMETER_UPSTREAM_API_KEY"
    max_body_bytes: Annotated[int, Field(gt=0)] = 8 * 1024 * 1024
    connect_timeout_seconds: Positive = 5.0
    read_timeout_seconds: Positive = 600.0
    on_spool_failure: Literal["refuse", "serve_unmetered"] = "refuse"
    # Unshipped records past this size are a spool failure (on_spool_failure applies).
    spool_max_bytes: Annotated[int, Field(gt=0)] = 1024 * 1024 * 1024
    # How long usage records billing acknowledged stay in the spool (``infermeter.spool``), to
    # be shipped again after billing's ledger is restored to a backup (0: deleted at once).
    spool_keep_acked_seconds: NonNegative = 0.0
    # An instance announces it is alive this often; billing closes one silent for 3 of these.
    heartbeat_seconds: Positive = 30.0
    # How often a sidecar asks whether the keys issued at run time changed (sidecar.keysync):
    # a new or revoked key is taken within about this plus one read.
    key_sync_seconds: Annotated[float, Field(gt=0, le=5)] = 1.0
    default_reserve_tokens: Annotated[int, Field(gt=0)] = 1024
    # Non-streamed completions are asked of vLLM as streams with continuous usage and answered
    # whole (``sidecar.assemble``), so a client that leaves is metered; false relays them as sent.
    non_streamed_via_stream: bool = True
    # A non-streamed request relayed whole (not answerable from vLLM's stream: tools, prompt
    # log-probabilities, beam search, ...) whose client leaves: "finish" reads vLLM's answer to its
    # end and bills its usage; "abort" closes the connection, so vLLM stops, billed 0 tokens.
    whole_hang_up: Literal["finish", "abort"] = "finish"
    # No effect: the relay has one upstream transport (sidecar.pool). Kept so configs that set it
    # still load; false logs a warning at start (docs/sidecar.md).
    protocol_relay: bool = True
    # The event loop the sidecar process runs on: uvloop (libuv; the relay's system calls and
    # callbacks cost less) or Python's own. "auto": uvloop when it is installed.
    event_loop: Literal["auto", "uvloop", "asyncio"] = "auto"
    fair_headroom: Annotated[float, Field(ge=0, lt=1)] = 0.125
    fair_queue_max_per_team: Annotated[int, Field(gt=0)] = 256
    fair_wait_timeout_seconds: Positive = 30.0
    header_timeout_seconds: Positive = 10.0
    body_timeout_seconds: Positive = 30.0
    max_connections: Annotated[int, Field(gt=0)] = 4096
    # On SIGTERM: how long admitted streams may still run (above the longest expected stream;
    # the pod's terminationGracePeriodSeconds must exceed it plus drain_ship_seconds), then how
    # long shipping the spool to billing may take before the process exits anyway.
    drain_seconds: NonNegative = 600.0
    drain_ship_seconds: NonNegative = 30.0
    # How often the admission journal ticks: non-streamed requests' tokens to their progress
    # slots, and an fsync of its files (``sidecar.journal``).
    journal_mark_millis: Annotated[int, Field(gt=0)] = 500
    # The prompt-prefix digest on usage records (``sidecar.prefix``): the variable holding the
    # deployment's key (unset: no digests) and how many characters of the first message it covers
    # (about 4 a token).
    prefix_key_env: str = "INFERMETER_PREFIX_KEY"
    prefix_digest_chars: Annotated[int, Field(gt=0)] = 2048
    gateway: GatewaySettings = GatewaySettings()
    shared_limits: SharedLimitsSettings = SharedLimitsSettings()
    budgets: BudgetSettings = BudgetSettings()


class RegistryDiscovery(_Strict):
    """Engine targets from billing's instance registry (``GET /v1/instances?state=live``)."""

    # Default: billing.url. Asked with the metrics token (collector.metrics_token_env).
    url: Url | None = None
    refresh_seconds: Positive = 30.0
    timeout_seconds: Positive = 5.0


class KubernetesDiscovery(_Strict):
    """Engine targets from the Kubernetes API: the vLLM pods, listed then watched.

    With no ``api_url`` the pod's service account is used (its token and CA). When the
    variable named by ``collector.node_name_env`` is set (the downward API's ``spec.nodeName``,
    as in a DaemonSet), only the pods on that node are watched.
    """

    api_url: Url | None = None
    token_env: str = "INFERMETER_KUBERNETES_TOKEN"
    ca_file: str | None = None
    namespace: Name = "default"
    label_selector: str = "app.kubernetes.io/component=vllm"
    # The pod label naming its replica group; without it the vllm-<group id> pod-name rule.
    replica_label: str = "infermeter.io/replica"
    # Each engine is read at http://<pod IP>:<sidecar_port>/engine/metrics (the sidecar's relay).
    sidecar_port: Annotated[int, Field(gt=0, lt=65536)] = 9000
    engine_metrics_path: str = "/engine/metrics"
    # A watch is reopened from its last resourceVersion after this long (the API server's own
    # limit may be shorter); a failed list or watch is retried after retry_seconds.
    watch_timeout_seconds: Annotated[int, Field(gt=0)] = 300
    retry_seconds: Positive = 5.0


class CollectorSettings(_Strict):
    """How ``infermeter collect`` scrapes GPUs and engines and where it sends samples."""

    listen: Listen = "127.0.0.1:19500"
    scrape_interval_seconds: Positive = 10.0
    scrape_timeout_seconds: Positive = 3.0
    gap_after_intervals: Annotated[float, Field(gt=1)] = 3.0
    max_backoff_seconds: Positive = 300.0
    source: Literal["dcgm", "nvml"] = "dcgm"
    spool_dir: str = "var/collector-spool"
    ingest_url: Url | None = None
    # The collector's writer credential, for the nodes it reads (``infermeter.writers``).
    credential_env: str = "INFERMETER_WRITER_CREDENTIAL"
    ingest_token_env: str = "INFERMETER_INGEST_TOKEN"
    # Sent as a bearer token to every engine_metrics_url when the variable is set: the sidecar's
    # /engine/metrics needs the metrics or admin token.
    metrics_token_env: str = "INFERMETER_METRICS_TOKEN"
    # The sidecars' spool root on this node (their ``sidecar.spool_dir``): spools whose sidecar
    # is gone are shipped from here. None: no adoption.
    adopt_spools_dir: str | None = None
    # On SIGTERM, how long the collector tries to ship what its spools hold before it exits.
    drain_ship_seconds: NonNegative = 5.0
    # This node's dcgm-exporter, for a collector that runs on every node (a DaemonSet): scraped
    # instead of nodes[].dcgm_exporter_url, under the node name in $NODE_NAME (else the host name).
    dcgm_exporter_url: Url | None = None
    # The variable holding this node's name (the downward API's spec.nodeName in a DaemonSet).
    node_name_env: str = "NODE_NAME"
    # Where the vLLM engines to scrape come from: replicas[] (static), billing's instance
    # registry, or the Kubernetes API. Targets come and go without a restart.
    discovery: Literal["static", "registry", "kubernetes"] = "static"
    registry: RegistryDiscovery = RegistryDiscovery()
    kubernetes: KubernetesDiscovery = KubernetesDiscovery()


# What a prompt token served from vLLM's prefix cache costs the engine, in uncached prompt
# tokens: measured on real vLLM by bench/prefix_cache_cost.py (docs/benchmarks.md).
CACHED_PROMPT_SHARE = 0.25


class TokenWeights(_Strict):
    """Relative weight of a prompt, a cached prompt and a completion token for the ``tokens`` split.

    ``cached_prompt`` weighs a prompt token vLLM found in its prefix cache; unset, it is
    ``CACHED_PROMPT_SHARE`` of the prompt weight given, so a file that sets only ``prompt``
    keeps the measured discount. It may not exceed ``prompt``: a cache hit never costs more.
    """

    prompt: NonNegative = 1.0
    cached_prompt: NonNegative = CACHED_PROMPT_SHARE
    completion: NonNegative = 3.0

    @model_validator(mode="before")
    @classmethod
    def _cached_from_prompt(cls, data: Any) -> Any:
        if not isinstance(data, dict) or "cached_prompt" in data or "prompt" not in data:
            return data
        try:  # a number, or its text (an environment variable); anything else fails below
            prompt = float(data["prompt"])
        except (TypeError, ValueError):
            return data
        return {**data, "cached_prompt": prompt * CACHED_PROMPT_SHARE}

    @model_validator(mode="after")
    def _cached_at_most_prompt(self) -> TokenWeights:
        if self.cached_prompt > self.prompt:
            raise ValueError(
                f"cached_prompt ({self.cached_prompt}) exceeds prompt ({self.prompt}): a prompt "
                "token served from the prefix cache cannot weigh more than an uncached one"
            )
        return self


class RetentionSettings(_Strict):
    """How long raw records stay in the ledger file before they move to the Parquet archive.

    ``archive`` is a directory on a filesystem with an atomic rename (a mounted volume, not an
    object store mounted without rename) or an fsspec URL (``s3://bucket/prefix``, ``gs://``...,
    with the filesystem's package installed: ``billing.archive_store``); ``interval_seconds`` is
    how often the billing service runs retention (0: never, leaving it to
    ``infermeter billing retain``).
    """

    raw_days: Annotated[int, Field(ge=1, le=36_500)] = 35
    archive: Annotated[str, StringConstraints(min_length=1)] = "var/archive"
    interval_seconds: NonNegative = 3600.0

    @field_validator("archive")
    @classmethod
    def _a_directory_or_a_url(cls, value: str) -> str:
        if "://" not in value or value.startswith("file://"):
            return value
        protocol = value.split("://", 1)[0]
        import fsspec  # only an archive at a URL needs it, and only to check the protocol

        try:
            fsspec.get_filesystem_class(protocol)
        except (ValueError, ImportError) as exc:
            raise ValueError(
                f"{protocol}:// is not a filesystem this installation can open ({exc}); "
                "name a directory, or install the filesystem's package (s3fs, gcsfs, adlfs)"
            ) from None
        return value


# A cluster's name in a federation: no "/", which separates it from the team in the central's
# FOCUS SubAccountId ("<cluster>/<team>").
ClusterName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")]


class FederatedCluster(_Strict):
    """A cluster a central billing pulls closed months from (``billing.federation``).

    The central presents the token in ``$token_env`` (never in the file); the cluster accepts it
    because its hash is in the cluster's ``federation_token_sha256``, for the federation routes
    only.
    """

    name: ClusterName
    url: Annotated[str, StringConstraints(pattern=r"^https?://[^\s/]+(/[^\s]*)?$")]
    token_env: Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")]


class FederationSettings(_Strict):
    """How a central billing pulls its clusters: every ``interval_seconds``, each request within
    ``timeout_seconds``, tried ``attempts`` times with exponential backoff before the cluster
    is marked stale until the next round; an answer larger than ``max_body_bytes`` is refused."""

    interval_seconds: Positive = 300.0
    timeout_seconds: Positive = 30.0
    attempts: Annotated[int, Field(ge=1, le=10)] = 3
    backoff_seconds: Positive = 1.0
    max_body_bytes: Annotated[int, Field(gt=0)] = 64 << 20


class BillingSettings(_Strict):
    """The billing service: the only process that writes the DuckDB ledger."""

    listen: Listen = "127.0.0.1:19600"
    url: Url = "http://127.0.0.1:19600"
    database: str = "var/infermeter.duckdb"
    memory_limit: Annotated[
        str, StringConstraints(pattern=r"^[0-9]+(\.[0-9]+)? *(KB|MB|GB|TB|KiB|MiB|GiB|TiB)$")
    ] = "2GB"
    threads: Annotated[int, Field(gt=0)] | None = None
    # The secret every writer credential is derived from (``infermeter.writers``), read from this
    # variable, never from the file.
    writer_secret_env: str = "INFERMETER_WRITER_SECRET"
    # Whether the one shared ingest token (its hash below) is still taken: it writes as any
    # instance, so it is off unless an installation that still ships with it turns it on.
    shared_ingest_token: bool = False
    ingest_token_sha256: list[Sha256] = Field(default_factory=list)
    max_batch_records: Annotated[int, Field(gt=0)] = 100_000
    # An ingest body, read as it arrives and refused (413) past this; an Arrow stream may not
    # decode to more either. 64 MiB holds a 50,000-record NDJSON segment about twice over.
    max_body_bytes: Annotated[int, Field(gt=0)] = 64 << 20
    body_read_timeout_seconds: Positive = 30.0
    # The server: open connections beyond which requests are 503, how long a request's headers
    # may take to arrive, and how long an idle keep-alive connection is kept.
    max_connections: Annotated[int, Field(gt=0)] = 512
    header_timeout_seconds: Positive = 10.0
    keep_alive_timeout_seconds: Annotated[int, Field(gt=0)] = 5
    # Reads (statements, files, queries) per caller: a token bucket per credential's principal.
    read_rate_per_second: Positive = 10.0
    read_burst: Annotated[int, Field(gt=0)] = 120
    statement_cache_entries: Annotated[int, Field(gt=0)] = 36
    # How long a cached statement (and the spend read from it) is served: unset, the dashboard's
    # refresh_seconds; never longer, so the pages, /v1/spend and the CLI agree within a refresh.
    statement_ttl_seconds: Positive | None = None
    max_clock_skew_seconds: NonNegative = 300.0
    allocation: Literal["in_flight", "tokens", "requests"] = "in_flight"
    token_weights: TokenWeights = TokenWeights()
    platform_account: Name = "platform"
    # Keys issued at run time in force at once per team (and for the roles' keys, together):
    # every sidecar holds the whole set, and billing publishes it whole after each change, so a
    # team lead must not be able to grow it without end. Rotating with a grace period counts the
    # successor; rotating without one, or revoking, makes room.
    max_keys_per_team: Annotated[int, Field(gt=0, le=100_000)] = 100
    export_dir: str = "var/exports"
    # Where ``POST /v1/admin/backup`` (``infermeter billing backup``) writes each backup, in a
    # new directory of the name the caller gives (billing.backup).
    backup_dir: str = "var/backups"
    # The share of a replica group's engine tokens in the last whole hour that no usage record
    # carries, over which the rendered rules raise InfermeterTokensUnattributed.
    reconciliation_alert_share: Annotated[float, Field(ge=0, le=1)] = 0.02
    # Board power limits (W) by GPU model, over infermeter.boards' table: a GPU sample drawing
    # more (with a margin) is refused at ingest as no board can draw it (billing.bounds).
    gpu_max_watts: dict[str, Positive] = Field(default_factory=dict)
    # Raw usage and samples older than this leave the ledger for a Parquet archive (billing.archive).
    retention: RetentionSettings = RetentionSettings()
    # A cluster's billing keeps its own ledger and serves its closed months to a central; a
    # central (the same service) also pulls every cluster of ``clusters`` (docs/deploy.md).
    role: Literal["cluster", "central"] = "cluster"
    cluster_name: ClusterName = "default"
    clusters: Annotated[list[FederatedCluster], Field(max_length=256)] = Field(default_factory=list)
    federation: FederationSettings = FederationSettings()

    @model_validator(mode="after")
    def _federation(self) -> BillingSettings:
        names = [c.name for c in self.clusters]
        if len(set(names)) != len(names):
            raise ValueError("billing.clusters: each cluster needs a name of its own")
        if self.clusters and self.role != "central":
            raise ValueError("billing.clusters is for billing.role: central only")
        return self


# What an IdP group may map to: a role of ``infermeter.auth`` or a team's lead or member.
_OIDC_ROLE = re.compile(r"(admin|finance|viewer|(lead|member):[A-Za-z0-9][A-Za-z0-9._:/-]{0,127})")


def _oidc_role(value: str) -> str:
    if not _OIDC_ROLE.fullmatch(value):
        raise ValueError("must be admin, finance, viewer, lead:<team> or member:<team>")
    return value


OidcRole = Annotated[str, AfterValidator(_oidc_role)]


class OidcSettings(_Strict):
    """Single sign-on (OpenID Connect): the dashboard signs people in with the code flow and
    PKCE, and billing's read routes take the ID token it was given as a bearer.

    ``groups`` maps a value of the ID token's ``groups_claim`` to ``admin``, ``finance``,
    ``viewer``, ``lead:<team>`` or ``member:<team>``; a person none of whose groups is mapped is
    refused. The client secret is read from the variable ``client_secret_env`` names, never
    from the file.
    """

    issuer: Annotated[str, StringConstraints(pattern=r"^https?://[^\s]+$")]
    client_id: Annotated[str, StringConstraints(min_length=1)]
    client_secret_env: str = "INFERMETER_OIDC_CLIENT_SECRET"
    # The sign-in button says "Sign in with <display_name>".
    display_name: Annotated[str, StringConstraints(min_length=1, max_length=60)] = "single sign-on"
    # Add the scope your IdP needs for the groups claim (often "groups").
    scopes: list[str] = Field(default_factory=lambda: ["openid", "profile", "email"])
    groups_claim: Annotated[str, StringConstraints(min_length=1)] = "groups"
    groups: dict[str, OidcRole] = Field(default_factory=dict)
    # Where the IdP sends the browser back: unset, this request's own address +
    # /auth/oidc/callback (behind a reverse proxy, set the public https:// address).
    redirect_url: Annotated[str, StringConstraints(pattern=r"^https?://[^\s]+$")] | None = None
    # A signed-in session ends this long after sign-in (or when the ID token expires, if sooner).
    session_seconds: Positive = 8 * 3600.0

    @model_validator(mode="after")
    def _needs_openid(self) -> OidcSettings:
        if "openid" not in self.scopes:
            raise ValueError(f"scopes = {self.scopes!r}: must include 'openid' (the ID token)")
        return self


class DashboardSettings(_Strict):
    """The Dash web app: where it listens and where it reads its data."""

    listen: Listen = "127.0.0.1:19800"
    billing_url: Url | None = None
    metrics_urls: list[Url] = Field(default_factory=list)
    # Prometheus's HTTP API (http://host:9090): the alerts that fired are marked on the charts.
    prometheus_url: Url | None = None
    refresh_seconds: Positive = 10.0
    # A request body over this is answered 413 before it is read (a callback's is a few KiB).
    max_body_bytes: Annotated[int, Field(gt=0)] = 1 << 20
    # Sign-ins and sign-in failures go on the audit trail: spooled here, shipped to billing with
    # the dashboard's writer credential (``dashboard:<name>``) from this variable.
    spool_dir: str = "var/spool/dashboard"
    credential_env: str = "INFERMETER_WRITER_CREDENTIAL"
    # Off (None): only the key form signs in.
    oidc: OidcSettings | None = None


class SlaOverride(_Strict):
    """A different target for one team's use of one model; unset keys keep the model's SLA."""

    team: Name
    model: Name
    ttft_p95_seconds: Positive | None = None
    min_output_tokens_per_second: NonNegative | None = None
    max_error_ratio: Annotated[float, Field(ge=0, le=1)] | None = None


class AlertSettings(_Strict):
    """How ``infermeter alerts render`` turns SLAs, scaling policy and budgets into rules.

    Windows and ``for`` durations are seconds; the rendered rules state them as Prometheus
    durations. The queue-backlog and GPU-idle alerts take theirs from ``scaling``.
    """

    evaluation_interval_seconds: Positive = 30
    rate_window_seconds: Positive = 300
    sla_for_seconds: NonNegative = 300
    spool_backlog_records: Annotated[int, Field(ge=0)] = 1000
    spool_backlog_for_seconds: NonNegative = 900
    target_down_for_seconds: NonNegative = 120
    budget_forecast_for_seconds: NonNegative = 3600
    # Engine efficiency: an instance's KV cache this full, or preempting this often, for
    # ``kv_cache_for_seconds``; a replica group's batches this empty for the longer wait.
    kv_cache_usage_ratio: Annotated[float, Field(gt=0, le=1)] = 0.9
    preemptions_per_second: NonNegative = 0.2
    kv_cache_for_seconds: NonNegative = 300
    low_batch_occupancy_ratio: Annotated[float, Field(ge=0, le=1)] = 0.2
    low_batch_occupancy_for_seconds: NonNegative = 3600
    slas: list[SlaOverride] = Field(default_factory=list)


class KubernetesHookSettings(_Strict):
    """Patch each model's Deployment ``scale`` subresource to the desired replica count.

    Dry-run by default: the API server validates the patch but changes nothing until
    ``dry_run`` is turned off. With no ``api_url`` the in-cluster service account is used.
    """

    enabled: bool = False
    api_url: Url | None = None
    token_env: str = "INFERMETER_KUBERNETES_TOKEN"
    ca_file: str | None = None
    namespace: str = "default"
    deployments: dict[Name, str] = Field(default_factory=dict)
    dry_run: bool = True


class LocalHookSettings(_Strict):
    """Start and stop simulated instances of a replica group on this machine (the demo's fleet).

    Each instance is one simulated vLLM replica process and its sidecar process, on free
    loopback ports, on spare GPUs of the configured nodes. See docs/autoscaling.md.
    """

    enabled: bool = False
    # model -> the replica group whose instances the hook starts (default: the model's first).
    groups: dict[Name, Name] = Field(default_factory=dict)
    # The config's replicas of the model run beside (``demo``/``simulate`` start them) and
    # count toward the desired number; off, the hook's instances are all the model has.
    count_fixed_replicas: bool = True
    namespace: Name = "local"
    ready_timeout_seconds: Positive = 30.0
    stop_timeout_seconds: Positive = 10.0
    # From marking a stopping instance draining in the instances file to its sidecar's SIGTERM:
    # its readers (the traffic, the front door) read the file every 2 s, and send it nothing
    # new once they have, as a cluster takes a pod out of its endpoints before stopping it.
    delist_seconds: NonNegative = 2.5


class AutoscaleSettings(_Strict):
    """The autoscaler (``infermeter autoscale run``): its inputs, hooks and predictive term."""

    listen: Listen = "127.0.0.1:19700"
    interval_seconds: Positive = 15.0
    collector_url: Url | None = None
    sidecar_urls: list[Url] = Field(default_factory=list)
    metrics_token_env: str = "INFERMETER_METRICS_TOKEN"
    prometheus_url: Url | None = None
    prometheus_queries: dict[
        Literal["current", "queue", "utilization", "ttft_p95", "tokens_per_gpu"], str
    ] = Field(default_factory=dict)
    webhook_url: Url | None = None
    webhook_secret_env: str = "INFERMETER_WEBHOOK_SECRET"
    webhook_timeout_seconds: Positive = 5.0
    kubernetes: KubernetesHookSettings = KubernetesHookSettings()
    predictive: bool = True
    target_gpu_utilization: Annotated[float, Field(gt=0, le=1)] = 0.7
    history_slot_seconds: Annotated[int, Field(ge=60, le=86400)] = 900
    history_days: Annotated[int, Field(gt=0)] = 7
    # Where the demand history and the last desired counts survive a restart ("" keeps them in
    # memory only).
    history_file: str = "var/autoscale-history.json"
    history_save_seconds: Positive = 5.0
    local: LocalHookSettings = LocalHookSettings()
    # Each change of a model's desired count is spooled here and shipped to billing's ingest
    # (kind scaling_decisions) when ingest_url is set; one autoscaler per directory.
    spool_dir: str = "var/autoscale-spool"
    ingest_url: Url | None = None
    # The autoscaler's writer credential (``infermeter.writers``).
    credential_env: str = "INFERMETER_WRITER_CREDENTIAL"
    ingest_token_env: str = "INFERMETER_INGEST_TOKEN"


class Simulator(_Strict):
    """Settings of the simulated fleet (``infermeter simulate``)."""

    seed: int = 7
    # The instances the autoscaler's local hook runs: read by the dcgm-exporter stand-in and
    # the traffic generator, written (atomically) by the hook.
    instances_file: str = "var/simulated-instances.json"
    # Where each simulator process writes the ground-truth log (``simulator.truth``); "" is off.
    truth_dir: str = ""
    gpus: dict[Name, GpuProfile] = Field(default_factory=dict)
    engines: dict[Name, EngineProfile] = Field(default_factory=dict)

    def engine_for(self, model: str) -> EngineProfile:
        """The timing profile of ``model``'s engines, or the default one."""
        return self.engines.get(model, EngineProfile())


class Config(_Strict):
    """The whole configuration, validated across sections."""

    teams: list[Team]
    models: list[Model]
    replicas: list[Replica]
    nodes: list[Node] = Field(default_factory=list)
    prices: Prices
    scaling: ScalingPolicy = ScalingPolicy()
    simulator: Simulator = Simulator()
    sidecar: SidecarSettings = SidecarSettings()
    collector: CollectorSettings = CollectorSettings()
    billing: BillingSettings = BillingSettings()
    dashboard: DashboardSettings = DashboardSettings()
    alerts: AlertSettings = AlertSettings()
    autoscale: AutoscaleSettings = AutoscaleSettings()
    admin_token_sha256: list[Sha256] = Field(default_factory=list)
    metrics_token_sha256: list[Sha256] = Field(default_factory=list)
    # The spend_reader role (``infermeter.auth``): what the sidecars hold to read every team's
    # month-to-date spend and the issued keys, instead of the admin token.
    spend_token_sha256: list[Sha256] = Field(default_factory=list)
    # The federation role: what a central billing holds to read this cluster's closed months
    # (``GET /v1/federation/months``), and nothing else.
    federation_token_sha256: list[Sha256] = Field(default_factory=list)

    @field_validator("teams", "models", "replicas", "nodes")
    @classmethod
    def _unique(cls, items: list[Any]) -> list[Any]:
        seen: set[str] = set()
        for item in items:
            key = getattr(item, "id", None) or item.name
            if key in seen:
                raise ValueError(f"duplicate {key!r}")
            seen.add(key)
        return items

    @model_validator(mode="after")
    def _cross_references(self) -> Config:
        models = {m.name: m for m in self.models}
        teams = {t.name for t in self.teams}
        problems = []
        for r in self.replicas:
            # A replica may run a version that is no longer approved (a rollback in progress):
            # its sidecar then refuses every request, so that is not a configuration error.
            if r.model not in models:
                problems.append(f"replica {r.id!r} names unknown model {r.model!r}")
            if r.gpu_model not in self.prices.usd_per_gpu_hour:
                problems.append(f"replica {r.id!r}: no price for GPU model {r.gpu_model!r}")
            if r.owner_team is not None and r.owner_team not in teams:
                problems.append(f"replica {r.id!r} names unknown owner_team {r.owner_team!r}")
        for i, o in enumerate(self.alerts.slas):
            if o.model not in models:
                problems.append(f"alerts.slas[{i}].model = {o.model!r}: no such model")
            if o.team not in teams:
                problems.append(f"alerts.slas[{i}].team = {o.team!r}: no such team")
        ttl = self.billing.statement_ttl_seconds
        if ttl is not None and ttl > self.dashboard.refresh_seconds:
            problems.append(
                f"billing.statement_ttl_seconds {ttl:g} is longer than dashboard.refresh_seconds "
                f"{self.dashboard.refresh_seconds:g}: pages would show figures older than a refresh"
            )
        oidc = self.dashboard.oidc
        for group, role in (oidc.groups if oidc else {}).items():
            team = role.partition(":")[2]
            if team and team not in teams:
                problems.append(f"dashboard.oidc.groups[{group!r}] = {role!r}: no such team")
        if self.billing.platform_account in teams:
            problems.append(
                f"billing.platform_account {self.billing.platform_account!r} is also a team name"
            )
        problems += self._names_that_match_nothing(models)
        problems += shared_credentials(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def _names_that_match_nothing(self, models: Mapping[str, Model]) -> list[str]:
        """Settings naming a model or replica the configuration does not have, and a GPU two
        replicas claim: each would be read as nothing (a hook that never scales its model, a
        GPU whose cost goes to the replica that named it first) rather than fail. (Node pools
        may name nodes the file does not list: a cluster's nodes are discovered.)"""
        problems = []
        replicas = {r.id for r in self.replicas}
        for model in self.autoscale.kubernetes.deployments:
            if model not in models:
                problems.append(f"autoscale.kubernetes.deployments[{model!r}]: no such model")
        for model, group in self.autoscale.local.groups.items():
            if model not in models:
                problems.append(f"autoscale.local.groups[{model!r}]: no such model")
            if group not in replicas:
                problems.append(f"autoscale.local.groups[{model!r}] = {group!r}: no such replica")
        for i, model in enumerate(self.sidecar.budgets.priority_models):
            if model not in models:
                problems.append(f"sidecar.budgets.priority_models[{i}] = {model!r}: no such model")
        for model in self.simulator.engines:
            if model not in models:
                problems.append(f"simulator.engines[{model!r}]: no such model")
        owner: dict[tuple[str, str], str] = {}
        for r in self.replicas:
            for gpu in r.gpus:
                first = owner.setdefault((r.node, str(gpu)), r.id)
                if first != r.id:
                    problems.append(
                        f"replica {r.id!r}: GPU {gpu} of node {r.node!r} is also replica "
                        f"{first!r}'s (its samples, and their cost, go to one of them only)"
                    )
        return problems

    @property
    def statement_ttl_seconds(self) -> float:
        """How long billing serves a cached statement: its own setting, else a dashboard refresh."""
        return self.billing.statement_ttl_seconds or self.dashboard.refresh_seconds

    def model(self, name: str) -> Model:
        """The model called ``name``; KeyError if there is none."""
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)

    def replica(self, replica_id: str) -> Replica:
        """The replica with id ``replica_id``; KeyError if there is none."""
        for r in self.replicas:
            if r.id == replica_id:
                return r
        raise KeyError(replica_id)

    def node_names(self) -> list[str]:
        """Every node named by ``nodes`` or by a replica, in first-seen order."""
        names = [n.name for n in self.nodes]
        names += [r.node for r in self.replicas if r.node not in names]
        return list(dict.fromkeys(names))


def credential_hashes(config: Config) -> list[tuple[str, str, str]]:
    """Every stored key hash as ``(principal, key path, digest)``, in file order.

    A principal is who the key makes the caller: a team (``team:<name>``), or ``admin``,
    ``metrics``, ``spend_reader``, ``federation`` or ``ingest``.
    """
    out = [
        (f"team:{t.name}", f"teams[{i}].api_key_sha256[{j}]", d)
        for i, t in enumerate(config.teams)
        for j, d in enumerate(t.api_key_sha256)
    ]
    for principal, path, digests in (
        ("admin", "admin_token_sha256", config.admin_token_sha256),
        ("metrics", "metrics_token_sha256", config.metrics_token_sha256),
        ("spend_reader", "spend_token_sha256", config.spend_token_sha256),
        ("federation", "federation_token_sha256", config.federation_token_sha256),
        ("ingest", "billing.ingest_token_sha256", config.billing.ingest_token_sha256),
    ):
        out += [(principal, f"{path}[{j}]", d) for j, d in enumerate(digests)]
    return out


def shared_credentials(config: Config) -> list[str]:
    """One problem per hash held by two principals: one key would then act as both.

    A team key that is also the ingest token could forge usage for every team. The problem names
    both key paths and neither the key nor its hash, so the message is safe to log.
    """
    first: dict[str, tuple[str, str]] = {}
    problems = []
    for principal, path, digest in credential_hashes(config):
        seen = first.setdefault(digest, (principal, path))
        if seen[0] != principal:
            problems.append(
                f"{seen[1]} and {path} hold the same key hash: each team, the admin, the "
                "metrics reader and the ingest token need a key of their own"
            )
    return problems


def default_config_path() -> Path:
    """The file ``--config`` falls back to: ``$INFERMETER_CONFIG`` or the embedded demo fleet."""
    env = os.environ.get("INFERMETER_CONFIG")
    return Path(env) if env else DEFAULT_CONFIG


def load_config(
    path: Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, str] | None = None,
) -> Config:
    """Read, override from the environment, and validate one configuration file.

    ``overrides``: ``INFERMETER__*`` settings a command's own arguments give (such as
    ``simulate --seed``); they win over the environment's, as an argument wins over a variable.
    """
    path = path or default_config_path()
    environ = os.environ if environ is None else environ
    if overrides:
        environ = {**environ, **overrides}
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(source, [f"cannot read file: {exc.strerror or exc}"]) from None
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[: exc.start].count(b"\n") + 1
        raise ConfigError(
            source, [f"line {line}: not UTF-8 text (byte {exc.object[exc.start]:#04x})"]
        ) from None
    try:
        raw = yaml.load(text, Loader=_YAML_LOADER)  # a safe loader (_YAML_LOADER)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        reason = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(source, [f"{where}malformed YAML: {reason}"]) from None
    if not isinstance(raw, dict):
        raise ConfigError(source, ["the top level must be a mapping of sections"])
    origins: dict[tuple[str | int, ...], str] = {}
    raw = apply_env_overrides(raw, environ, source, origins)
    try:
        return Config.model_validate(raw)
    except ValidationError as exc:
        errors = exc.errors()
        raise ConfigError(
            source,
            [_describe(err, raw) for err in errors],
            [_origin(err, origins, source) for err in errors],
        ) from None


def apply_env_overrides(
    raw: dict[str, Any],
    environ: Mapping[str, str],
    source: str,
    origins: dict[tuple[str | int, ...], str] | None = None,
) -> dict[str, Any]:
    """Return ``raw`` with every ``INFERMETER__`` variable applied, in sorted order.

    ``origins`` receives the key path each variable set (list entries by index), so a value
    that then fails validation is blamed on its variable rather than on the file.
    """
    for var in sorted(environ):
        if not var.upper().startswith(ENV_PREFIX):
            continue
        parts = [p for p in var[len(ENV_PREFIX) :].split("__") if p]
        if not parts:
            continue
        try:
            value = yaml.load(environ[var], Loader=_YAML_LOADER)  # a safe loader
        except yaml.YAMLError as exc:
            reason = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ConfigError(
                f"environment variable {var}", [f"malformed YAML value: {reason}"]
            ) from None
        try:
            path = _set_path(raw, parts, value, Config)
        except (KeyError, IndexError, TypeError) as exc:
            reason = exc.args[0] if exc.args else exc
            raise ConfigError(f"environment variable {var}", [f"no such key: {reason}"]) from None
        if origins is not None:
            origins[tuple(path)] = var
    return raw


def _origin(err: Any, origins: Mapping[tuple[str | int, ...], str], source: str) -> str:
    """Where the value of a validation error came from: the variable that set it, else the file.

    An unknown key is the variable's when the variable created it (its path runs through it).
    """
    loc = tuple(err["loc"])
    for length in range(len(loc), 0, -1):
        var = origins.get(loc[:length])
        if var is not None:
            return f"environment variable {var}"
    if err["type"] == "extra_forbidden" and loc:
        for path, var in origins.items():
            if path[: len(loc)] == loc:
                return f"environment variable {var}"
    return source


def _norm(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "_", text.lower())


def _set_path(node: Any, parts: list[str], value: Any, shape: Any = None) -> list[str | int]:
    """Set ``value`` at ``parts`` below ``node``; the key path it went to (list entries by index).

    ``shape``: what the settings declare at ``node`` (``Config`` at the top; None: not known,
    as below a key the settings do not have, which validation then refuses). A key the node
    does not hold yet is a field's name, lower-cased, below a section; below a mapping of names
    (GPU models' prices, a model's deployment) it is kept as the variable spells it, since
    ``B200`` and ``b200`` are two GPU models."""
    head, rest = parts[0], parts[1:]
    if isinstance(node, dict):
        fields = _fields(shape)
        new = head if fields is None and shape is not None else head.lower()
        key = next((k for k in node if _norm(str(k)) == _norm(head)), new)
        inner = _inner(shape, str(key))
        if not rest:
            node[key] = value
            return [key]
        if key not in node:
            node[key] = {}
        return [key, *_set_path(node[key], rest, value, inner)]
    if isinstance(node, list):
        index = _list_index(node, head)
        if not rest:
            node[index] = value
            return [index]
        return [index, *_set_path(node[index], rest, value, _inner(shape, None))]
    raise TypeError(f"{head!r} is below a plain value")


def _unwrapped(shape: Any) -> Any:
    """``shape`` without ``Optional`` and ``Annotated``: the model, mapping or list it is."""
    while True:
        origin = get_origin(shape)
        if origin is Annotated:
            shape = get_args(shape)[0]
        elif origin in (Union, UnionType):
            options = [a for a in get_args(shape) if a is not type(None)]
            if len(options) != 1:
                return None
            shape = options[0]
        else:
            return shape


def _fields(shape: Any) -> dict[str, Any] | None:
    """The fields of ``shape`` when it is a section (a settings model), else None."""
    shape = _unwrapped(shape)
    if isinstance(shape, type) and issubclass(shape, BaseModel):
        return {n: f.annotation for n, f in shape.model_fields.items()}
    return None


def _inner(shape: Any, key: str | None) -> Any:
    """What the settings declare below ``shape`` at ``key`` (a field, or any key of a mapping,
    or any entry of a list when ``key`` is None); None when unknown."""
    fields = _fields(shape)
    if fields is not None:
        return fields.get(key or "")
    shape = _unwrapped(shape)
    args = get_args(shape)
    if get_origin(shape) is dict and len(args) == 2:
        return args[1]
    if get_origin(shape) is list and args:
        return args[0]
    return None


def _list_index(items: list[Any], head: str) -> int:
    idents = []
    for i, item in enumerate(items):
        if isinstance(item, dict):
            ident = item.get("id", item.get("name"))
            if ident is not None and _norm(str(ident)) == _norm(head):
                return i
            if ident is not None:
                idents.append(str(ident))
    if head.isdigit() and int(head) < len(items):
        return int(head)
    known = f"; the entries are {', '.join(idents)}" if idents else ""
    raise KeyError(f"no entry {head!r}{_did_you_mean(head.lower(), idents) or known}")


def _did_you_mean(word: str, choices: list[str]) -> str:
    """`` (did you mean 'x'?)`` for the choice closest to ``word``, or nothing.

    A word close to the start of a longer key counts too (``budgt`` for ``budget_usd_per_month``).
    """
    names = {_norm(c): c for c in choices}
    typed = _norm(word)
    close = difflib.get_close_matches(typed, list(names), n=1, cutoff=0.6)
    if not close:
        heads = {name[: len(typed) + 1]: name for name in names}
        near = difflib.get_close_matches(typed, list(heads), n=1, cutoff=0.8)
        close = [heads[near[0]]] if near else []
    return f" (did you mean {names[close[0]]!r}?)" if close else ""


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model an annotation holds (``X``, ``X | None``, ``list[X]``), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _keys_at(loc: tuple[Any, ...]) -> list[str]:
    """The keys the configuration allows in the mapping at ``loc`` (empty when not a model)."""
    model: type[BaseModel] = Config
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        inner = _model_in(field.annotation) if field is not None else None
        if inner is None:
            return []
        model = inner
    return list(model.model_fields)


# What a pattern of a field asks for, said in words (pydantic gives the regular expression).
_PATTERNS: Final = {
    r"^https?://[^/\s]+(/\S*)?$": "an http:// or https:// URL expected (such as http://host:8000)",
    r"^(rediss?|unix)://\S+$": "a redis://, rediss:// or unix:// URL expected",
}


def _describe(err: Any, raw: Any) -> str:
    """Turn one pydantic error into ``key.path = value: reason``."""
    path = ""
    for part in err["loc"]:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    reason = err["msg"].removeprefix("Value error, ")
    if err["type"] == "string_pattern_mismatch":
        reason = _PATTERNS.get(str(err.get("ctx", {}).get("pattern")), reason)
    if err["type"] == "extra_forbidden":
        return f"{path}: unknown key{_did_you_mean(str(err['loc'][-1]), _keys_at(err['loc'][:-1]))}"
    if err["type"] == "missing":
        return f"{path}: required key is missing"
    value = err.get("input")
    if any(str(part).endswith("_sha256") for part in err["loc"]):
        # What sits in a hash field may be a key pasted by mistake: never echo it.
        return f"{path}: {reason}"
    if isinstance(value, dict | list):
        return f"{path or '(top level)'}: {reason}"
    return f"{path} = {value!r}: {reason}"


def env_value(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The environment variable ``name`` (a secret a ``*_env`` setting names); None when unset."""
    return (os.environ if environ is None else environ).get(name)


def process_environment() -> Mapping[str, str]:
    """The process's environment, for the functions that take one (``environ``) to read a
    variable a setting names or the pod's own facts (the downward API).

    This module is where the product reads the environment: the settings' overrides, and through
    ``env_value`` and this function the secrets and facts named by ``*_env`` settings. Tests pass
    a mapping of their own instead.
    """
    return os.environ
