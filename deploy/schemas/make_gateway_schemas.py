"""Write the Gateway API and Inference Extension schemas deploy/schemas keeps (README.md there).

Written from the projects' API references (no registry package carries their CRDs): the parts of
each spec the manifests use, every object closed (``additionalProperties: false``).
"""

import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

Schema = dict[str, Any]

NAME = {"type": "string", "minLength": 1, "maxLength": 253}
GROUP = {
    "type": "string",
    "maxLength": 253,
    "pattern": r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
}
KIND = {
    "type": "string",
    "minLength": 1,
    "maxLength": 63,
    "pattern": r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$",
}
NAMESPACE = {
    "type": "string",
    "minLength": 1,
    "maxLength": 63,
    "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
}
PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
LABEL_VALUE = {
    "type": "string",
    "maxLength": 63,
    "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$",
}
DURATION = {"type": "string", "pattern": r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"}
META = {
    "type": "object",
    "properties": {
        "name": NAME,
        "namespace": NAMESPACE,
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
    "required": ["name"],
    "additionalProperties": False,
}


def strict(props: Schema, required: Iterable[str] = ()) -> Schema:
    out: Schema = {"type": "object", "properties": props, "additionalProperties": False}
    if required:
        out["required"] = list(required)
    return out


def top(api: str, kind: str, spec: Schema, source: str) -> Schema:
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$comment": f"{api} {kind}: {source}",
        "type": "object",
        "properties": {
            "apiVersion": {"const": api},
            "kind": {"const": kind},
            "metadata": META,
            "spec": spec,
        },
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
    }


pool = strict(
    {
        "selector": strict(
            {
                "matchLabels": {
                    "type": "object",
                    "additionalProperties": LABEL_VALUE,
                    "minProperties": 1,
                }
            },
            ["matchLabels"],
        ),
        "targetPorts": {
            "type": "array",
            "minItems": 1,
            "maxItems": 1,
            "items": strict({"number": PORT}, ["number"]),
        },
        "endpointPickerRef": strict(
            {
                "group": GROUP,
                "kind": KIND,
                "name": NAME,
                "port": strict({"number": PORT}, ["number"]),
                "failureMode": {"enum": ["FailOpen", "FailClose"]},
            },
            ["name"],
        ),
    },
    ["selector", "targetPorts", "endpointPickerRef"],
)

objective = strict(
    {
        "priority": {"type": "integer"},
        "poolRef": strict({"group": GROUP, "kind": KIND, "name": NAME}, ["name"]),
    },
    ["poolRef"],
)

header_match = strict(
    {
        "type": {"enum": ["Exact", "RegularExpression"]},
        "name": {
            "type": "string",
            "minLength": 1,
            "maxLength": 256,
            "pattern": r"^[A-Za-z0-9!#$%&'*+\-.^_`|~]+$",
        },
        "value": {"type": "string", "minLength": 1, "maxLength": 4096},
    },
    ["name", "value"],
)
path_match = strict(
    {
        "type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]},
        "value": {"type": "string", "maxLength": 1024},
    }
)
match = strict(
    {
        "path": path_match,
        "headers": {"type": "array", "maxItems": 16, "items": header_match},
        "queryParams": {"type": "array", "maxItems": 16, "items": header_match},
        "method": {
            "enum": ["GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"]
        },
    }
)
backend = strict(
    {
        "group": GROUP,
        "kind": KIND,
        "name": NAME,
        "namespace": NAMESPACE,
        "port": PORT,
        "weight": {"type": "integer", "minimum": 0, "maximum": 1000000},
    },
    ["name"],
)
parent = strict(
    {
        "group": GROUP,
        "kind": KIND,
        "namespace": NAMESPACE,
        "name": NAME,
        "sectionName": {"type": "string", "minLength": 1, "maxLength": 253},
        "port": PORT,
    },
    ["name"],
)
route = strict(
    {
        "parentRefs": {"type": "array", "maxItems": 32, "items": parent},
        "hostnames": {
            "type": "array",
            "maxItems": 16,
            "items": {"type": "string", "minLength": 1, "maxLength": 253},
        },
        "rules": {
            "type": "array",
            "maxItems": 16,
            "items": strict(
                {
                    "name": {"type": "string", "minLength": 1, "maxLength": 253},
                    "matches": {"type": "array", "maxItems": 64, "items": match},
                    "backendRefs": {"type": "array", "maxItems": 16, "items": backend},
                    "timeouts": strict({"request": DURATION, "backendRequest": DURATION}),
                }
            ),
        },
    }
)

out = Path(sys.argv[1])
for name, doc in {
    "inference.networking.k8s.io_v1_inferencepool.json": top(
        "inference.networking.k8s.io/v1",
        "InferencePool",
        pool,
        "written from the Gateway API Inference Extension v1.0 API reference: the fields the manifests use (deploy/schemas/README.md)",
    ),
    "inference.networking.x-k8s.io_v1alpha2_inferenceobjective.json": top(
        "inference.networking.x-k8s.io/v1alpha2",
        "InferenceObjective",
        objective,
        "written from the Gateway API Inference Extension v1.0 API reference: the fields the manifests use (deploy/schemas/README.md)",
    ),
    "gateway.networking.k8s.io_v1_httproute.json": top(
        "gateway.networking.k8s.io/v1",
        "HTTPRoute",
        route,
        "written from the Gateway API v1.3 standard-channel API reference: the fields the manifests use (deploy/schemas/README.md)",
    ),
}.items():
    (out / name).write_text(json.dumps(doc, indent=1) + "\n")
