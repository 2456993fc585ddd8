"""Write the JSON schema deploy/schemas keeps for one version of a CRD (README.md there).

Derived from the CRD's own ``openAPIV3Schema`` (a JSON schema in OpenAPI's dialect), with the
changes the other schemas here carry: ``additionalProperties: false`` on every object with fixed
properties (what the API server's strict field validation enforces), ``apiVersion`` and ``kind``
constants and required with ``metadata`` and ``spec``, ``status`` left out, and ``metadata`` the
ObjectMeta of the schema it replaces (a CRD says only ``type: object`` there).

    python deploy/schemas/make_crd_schema.py CRD.yaml VERSION SOURCE OUT.json
"""

import json
import sys
from pathlib import Path
from typing import Any

import yaml


def strict(node: Any) -> Any:
    """``node`` with every object of fixed properties closed, and Kubernetes' own keys dropped."""
    if isinstance(node, dict):
        out = {k: strict(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
        if (
            out.get("type") == "object"
            and "properties" in out
            and "additionalProperties" not in out
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [strict(v) for v in node]
    return node


def schema(crd: dict[str, Any], version: str, source: str, meta: dict[str, Any]) -> dict[str, Any]:
    """The schema of ``crd``'s ``version``; ``meta``: the ``metadata`` schema and its ``$defs``."""
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    [served] = [v for v in crd["spec"]["versions"] if v["name"] == version]
    body = strict(served["schema"]["openAPIV3Schema"])
    body.pop("description", None)
    properties = body["properties"]
    properties.pop("status", None)
    api = f"{group}/{version}"
    properties["apiVersion"] = {"const": api}
    properties["kind"] = {"const": kind}
    properties["metadata"] = meta["metadata"]
    body["required"] = ["apiVersion", "kind", "metadata", "spec"]
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$comment": (
            f"{api} {kind}, from the CRD's openAPIV3Schema in {source}; additionalProperties: "
            "false added on every object with fixed properties (what the API server's strict "
            "field validation enforces); status omitted; metadata: ObjectMeta."
        ),
        "$defs": meta["$defs"],
        **body,
    }


def main(argv: list[str]) -> None:
    crd_path, version, source, out = argv
    crd = yaml.safe_load(Path(crd_path).read_text(encoding="utf-8"))
    target = Path(out)
    old = json.loads(target.read_text(encoding="utf-8"))
    defs = {k: v for k, v in old["$defs"].items() if k in _META_DEFS}
    meta = {"metadata": {"$ref": "#/$defs/ObjectMeta"}, "$defs": defs}
    target.write_text(json.dumps(schema(crd, version, source, meta), indent=1) + "\n")


# The definitions ObjectMeta refers to, kept from the schema being replaced.
_META_DEFS = ("ObjectMeta", "ManagedFieldsEntry", "FieldsV1", "OwnerReference", "Time")


if __name__ == "__main__":
    main(sys.argv[1:])
