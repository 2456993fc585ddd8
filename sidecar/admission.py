"""Admission: what the sidecar decides about a generation request before anything is forwarded.

Pure functions over the request's head and body and the configuration's ``View``: who calls,
whether the body is a request the sidecar can meter, which model serves it, how many tokens it
reserves and what exactly goes upstream. Each returns a typed ``Plan`` or a ``Refusal`` (the
OpenAI error the client gets), so every rule is testable without a server. All of it runs before
the team limits are asked: a request refused here takes nothing from any bucket. What needs state
that changes under the request (limits, budgets, fair share, the spool) is asked by the caller,
in the order the module docstring of ``sidecar.app`` gives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import orjson
from pydantic import TypeAdapter, ValidationError

from infermeter.auth import Signed, bearer_key
from infermeter.records import RequestStatus
from sidecar.bounds import capped
from sidecar.limits import estimate_prompt_tokens
from sidecar.prefix import Prefix, prefix_of
from sidecar.request_ids import client_request_id
from sidecar.state import ModelNotFoundError, View
from sidecar.tags import TagRefusal, user_of

__all__ = [
    "GENERATE",
    "Headers",
    "Plan",
    "Refusal",
    "first_header",
    "gateway_signed",
    "identify",
    "parse_body",
    "plan",
    "tag_refusal",
    "upstream_headers",
]

Headers = Sequence[tuple[bytes, bytes]]

# The generation endpoints and their operation names (OpenTelemetry's gen_ai.operation.name).
GENERATE = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    "/v1/embeddings": "embeddings",
}
# Headers never passed upstream: hop-by-hop ones, the caller's credentials, and what the client
# library sets. ``expect``: the sidecar has the whole body before it forwards, so there is
# nothing for vLLM to let through, and its interim ``100 Continue`` would only come first.
_DROP = frozenset(
    {
        b"expect",
        b"proxy-connection",
        b"authorization",
        b"host",
        b"content-length",
        b"connection",
        b"keep-alive",
        b"transfer-encoding",
        b"te",
        b"upgrade",
        b"proxy-authorization",
        b"accept-encoding",
    }
)


# The integer fields the sidecar reads to meter and reserve. vLLM validates its requests with
# pydantic in lax mode, which takes ``"2"``, ``2.0`` or ``true`` for an integer; read only as
# ``int`` here, such a value made the sidecar meter one choice of a stream vLLM ran as several,
# and reserve for one. They are read as vLLM reads them (``_whole``) and sent to it as integers.
_INTEGERS = ("n", "max_tokens", "max_completion_tokens")
_LAX_INT: TypeAdapter[int] = TypeAdapter(int)


def _whole(value: Any) -> int | None:
    """``value`` as vLLM's validation reads an integer field, or None where it refuses it."""
    try:
        return _LAX_INT.validate_python(value)
    except ValidationError:
        return None


def _integers(body: dict[str, Any]) -> None:
    """Write the integer fields that are not JSON integers as the integers vLLM reads them as;
    a value vLLM refuses is left for it to refuse (nothing is generated for it)."""
    for key in _INTEGERS:
        value = body.get(key)
        if value is not None and type(value) is not int:
            whole = _whole(value)
            if whole is not None:
                body[key] = whole


# What a request body may hold, counted before it is parsed. Parsing runs on the event loop that
# serves every team, and what it costs follows what the body holds, not its size: 8 MiB of
# ``[],`` is 2.8 million lists, 0.86 s of the loop and 243 MB; of ``1,``, 4 million numbers,
# 86 ms and 104 MB; of one long string, 7 ms (``python -m bench.body_parse``). Opening brackets
# bound the containers, commas the values. Both are counted in strings too (a count that skips
# strings is a scan dearer than the parse it would spare), so a text may be refused for the
# brackets it holds: 300,000 of them, about 4 MB of source code, a million tokens or more. A chat
# of a thousand messages holds a few thousand containers, a batch of prompts as token ids a
# value per token. The most a body within both bounds costs to parse: ``bench.body_parse``.
MAX_JSON_CONTAINERS: Final = 300_000
MAX_JSON_VALUES: Final = 1_000_000


def _too_complex(raw: bytes) -> str | None:
    """What ``raw`` holds more of than the bounds allow, or None (one scan of C per bound, and
    none for a body too short to hold that many: each container or value takes two bytes)."""
    if (
        len(raw) > 2 * MAX_JSON_CONTAINERS
        and raw.count(b"[") + raw.count(b"{") > MAX_JSON_CONTAINERS
    ):
        return f"more than {MAX_JSON_CONTAINERS} JSON objects and arrays"
    if len(raw) > 2 * MAX_JSON_VALUES and raw.count(b",") >= MAX_JSON_VALUES:
        return f"more than {MAX_JSON_VALUES} JSON values"
    return None


class Refusal(Exception):
    """An answer decided before forwarding: status, OpenAI error and extra headers.

    An exception as well as a value, so the steps after admission (limits, fair share, the
    upstream's head) can end the request the same way from any depth.
    """

    def __init__(
        self,
        status: int,
        message: str,
        err_type: str,
        code: str | None,
        record_status: RequestStatus,
        headers: tuple[tuple[str, str], ...] = (),
        param: str | None = None,
        model: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.err_type, self.code = status, message, err_type, code
        self.record_status, self.headers, self.param = record_status, headers, param
        # The model the client asked for, when the refusal is that no such model is served.
        self.model = model


@dataclass(frozen=True)
class Plan:
    """What to forward for an identified team's request, and what to meter it as."""

    model: str
    served_version: str
    # The model as the client named it (for the span), the served alias when it named none.
    requested: str
    stream: bool
    # What the client asked of the stream; the sidecar always asks vLLM for both.
    client_usage: bool
    client_continuous: bool
    reserve_tokens: int
    # The request for vLLM, as a dict (the assembling path rewrites it once more).
    body: dict[str, Any]
    # The keyed digest of the prompt's head (sidecar.prefix), when the deployment has a key.
    prefix: Prefix | None = None
    # Choices per prompt when a stream carries several (n > 1, or a batch of prompts), else 0.
    choices: int = 0
    # The end user the body names (OpenAI's ``user``, forwarded as sent), checked.
    user: str | None = None
    # The sequences it puts in vLLM's batch (prompts x choices): its weight in the fair share.
    sequences: int = 1


def _choices(endpoint: str, body: dict[str, Any], n: int) -> int:
    """``n`` when the answer has several choices, else 0 (one prompt, one choice)."""
    prompt = body.get("prompt") if endpoint == "/v1/completions" else None
    # A list of strings or of token lists is a batch; a list of ints is one tokenised prompt.
    batch = isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int)
    return max(1, n) if n > 1 or batch else 0


def _sequences(endpoint: str, body: dict[str, Any], n: int) -> int:
    """The sequences vLLM runs for the request: ``n`` for each prompt of a batch."""
    prompt = body.get("prompt") if endpoint == "/v1/completions" else None
    batch = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
    return (len(prompt) if batch and isinstance(prompt, list) else 1) * max(1, n)


def first_header(headers: Headers, name: bytes) -> str | None:
    """The first value of header ``name`` (lower-case bytes), or None."""
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return None


def gateway_signed(view: View, headers: Headers) -> bool:
    """True when a gateway is configured and this request carries its team header."""
    gateway = view.gateway
    return gateway is not None and first_header(headers, gateway.team_header.encode()) is not None


def identify(
    view: View, method: str, path: str, headers: Headers, body: bytes = b""
) -> str | Signed:
    """The calling team by its key or, in gateway mode, the request its signature proves.

    A signed request's nonce is still to be checked against the nonces served before
    (``sidecar.nonces.team_of``). AuthError when neither proves a team.
    """
    if view.gateway is not None and gateway_signed(view, headers):
        named = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers}
        return view.gateway.verify(named, method, path, body)
    return view.keys.team_for(bearer_key(first_header(headers, b"authorization")))


def parse_body(raw: bytes) -> dict[str, Any] | Refusal:
    """The request's JSON object, or the 400 a client gets for a body that is not one (the
    413 for one that holds more than the sidecar parses)."""
    too_much = _too_complex(raw)
    if too_much is not None:
        return Refusal(
            413,
            f"The request body holds {too_much}.",
            "invalid_request_error",
            "request_too_large",
            RequestStatus.BAD_REQUEST,
        )
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return Refusal(
            400,
            f"We could not parse the JSON body of your request. ({exc})",
            "invalid_request_error",
            "invalid_json",
            RequestStatus.BAD_REQUEST,
        )
    if not isinstance(body, dict):
        return Refusal(
            400,
            "The request body must be a JSON object.",
            "invalid_request_error",
            "invalid_json",
            RequestStatus.BAD_REQUEST,
        )
    if not isinstance(body.get("stream_options", {}), dict | None):
        # It is read to rewrite the stream; vLLM refuses it anyway.
        return Refusal(
            400,
            "'stream_options' must be an object or null.",
            "invalid_request_error",
            "invalid_type",
            RequestStatus.BAD_REQUEST,
            param="stream_options",
        )
    return body


def plan(
    view: View, endpoint: str, raw: bytes, *, default_reserve_tokens: int, metering_down: bool
) -> Plan | Refusal:
    """The plan for an identified team's request body ``raw`` on ``endpoint``, or its refusal.

    ``metering_down``: the spool failed and the sidecar refuses what it cannot meter.
    """
    body = parse_body(raw)
    if isinstance(body, Refusal):
        return body
    requested = body.get("model")
    try:
        route = view.route(requested if isinstance(requested, str) else None)
    except ModelNotFoundError as exc:
        return Refusal(
            404,
            str(exc),
            "invalid_request_error",
            "model_not_found",
            RequestStatus.REJECTED,
            model=capped(str(requested)),
        )
    try:
        user = user_of(body)  # from the one parse of the body, before anything is forwarded
    except TagRefusal as exc:
        return tag_refusal(exc)
    if metering_down:
        return Refusal(
            503,
            "Usage metering is unavailable; the request was not served.",
            "server_error",
            "metering_unavailable",
            RequestStatus.REJECTED,
        )
    _integers(body)
    stream = bool(body.get("stream")) and endpoint != "/v1/embeddings"
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    n_raw = body.get("n")
    n = n_raw if isinstance(n_raw, int) else 1
    out = max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else default_reserve_tokens
    reserve = estimate_prompt_tokens(len(raw)) + out * max(1, n)
    options = body.get("stream_options") or {}
    usage = bool(options.get("include_usage"))
    continuous = usage and bool(options.get("continuous_usage_stats"))
    prefix = prefix_of(view.prefix, body)
    body["model"] = route.served_version
    if stream:
        body["stream_options"] = {**options, "include_usage": True, "continuous_usage_stats": True}
    return Plan(
        route.model,
        route.served_version,
        str(requested or route.model),
        stream,
        usage,
        continuous,
        reserve,
        body,
        prefix,
        _choices(endpoint, body, n),
        user,
        1 if endpoint == "/v1/embeddings" else _sequences(endpoint, body, n),
    )


def tag_refusal(exc: TagRefusal) -> Refusal:
    """The 400 a client gets for a project or user it may not send (``sidecar.tags``)."""
    return Refusal(
        400,
        exc.message,
        "invalid_request_error",
        exc.code,
        RequestStatus.BAD_REQUEST,
        param=exc.param,
    )


def upstream_headers(view: View, headers: Headers, upstream_key: str | None) -> dict[str, str]:
    """The headers sent to vLLM: the client's, less credentials, hop-by-hop and our own.

    The gateway's signed headers, and anything in the sidecar's own ``x-infermeter-*``
    namespace, stay here: vLLM learns nothing of who called or how they proved it.
    """
    gateway = view.gateway
    signed = frozenset(h.lower().encode() for h in gateway.headers) if gateway else frozenset()
    out: dict[str, str] = {}
    for k, v in headers:
        if k not in _DROP and k not in signed and not k.startswith(b"x-infermeter-"):
            # A header sent twice goes upstream with its first value, the one the sidecar reads
            # and checks (``first_header``): the last would reach vLLM unchecked.
            out.setdefault(k.decode("latin-1"), v.decode("latin-1"))
    if "x-request-id" in out and client_request_id(first_header(headers, b"x-request-id")) is None:
        del out["x-request-id"]
    if upstream_key:
        out["authorization"] = f"Bearer {upstream_key}"
    return out
