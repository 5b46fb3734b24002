"""``memfit profile --json``: the machine-readable report, its schema, and a check against it.

The report is one JSON object (``REPORT_SCHEMA`` below is its JSON Schema, draft 2020-12 subset).
Sizes are bytes (integers), times seconds, FLOPs counts; every number is measured unless its name
says ``predicted``. Top-level keys:

``schema``          ``"memfit-profile/2"``; the number changes when a key changes meaning (2: the
                    per-policy list is ``policies``, each entry naming its ``policy``).
``memfit_version``, ``torch_version``, ``target`` (as given), ``model`` (class name),
``device``, ``dtype`` (of the parameters), ``batch_dim``, ``batch_size`` (of the example inputs)
``parameters``      ``count``, ``bytes``; ``buffers_bytes``; ``inputs``: ``name``, ``shape``,
                    ``dtype`` of every input tensor.
``activations``     what plain autograd saves for backward (``method`` says how it is measured):
                    ``total_bytes``, ``memfit_none_kept_bytes`` (what memfit's ``"none"`` plan
                    keeps, for comparison), ``by_module`` (every submodule with saved tensors:
                    ``self_bytes`` made by its own code, ``total_bytes`` with its children,
                    ``tensors``), ``largest_tensors`` (the 20 largest: ``bytes``, ``shape``,
                    ``dtype``, producing ``module``, ``saved_by`` backward nodes).
``policies``        one entry per policy: ``label``, ``policy`` (its name: ``none``, ``speed``,
                    ``memory``, ``collection`` or ``budget``), ``budget_bytes``/``budget_fraction``
                    (budgets only), ``call`` (the Python call), ``peak_bytes`` (measured, above the
                    step's start), ``predicted_peak_bytes``, ``peak_ratio`` and ``time_ratio`` (to
                    ``none``), ``step_time_s`` (median of ``step_times_s``), ``first_step_s``
                    (capture, planning, compilation and one step), ``recompute_flops``,
                    ``forward_flops``, ``kept_tensors``, ``kept_bytes``, ``recomputed_ops``,
                    ``graphs`` (captured pieces), ``recaptured`` (planned again while measured).
``max_batch``       ``null`` without ``--budget``; else ``budget_bytes``, ``covers`` (what the
                    budget counts), ``batch_step``, ``limit`` and per policy ``max_batch`` (0:
                    none fits),
                    ``total_bytes`` at it, ``first_not_fitting`` (measured), ``capped``, ``probes``
                    (every measured ``batch``, ``total_bytes``, ``fits``, ``error``).
``pareto``          ``null`` without ``--pareto``; else the planner's frontier, by peak:
                    ``peak_bytes`` (predicted), ``recompute_flops``, ``recompute_seconds``.
``figures``         paths of the ``timeline`` PNG and the ``pareto`` PNG (or ``null``).

``validate(report)`` returns the list of violations (empty when the report conforms); it implements
the keywords the schema uses (type, properties, required, additionalProperties, items, enum,
minimum), so no ``jsonschema`` dependency is needed.
"""

from __future__ import annotations

from typing import Any

from memfit.cli.steps import PolicyResult
from memfit.planning.policy import BUDGET, NAMED

__all__ = [
    "REPORT_SCHEMA",
    "SCHEMA_ID",
    "validate",
    "policy_entry",
    "activations_entry",
    "search_entry",
]

SCHEMA_ID = "memfit-profile/2"

_INT = {"type": "integer", "minimum": 0}
_INT_OR_NULL = {"type": ["integer", "null"], "minimum": 0}
_NUM = {"type": "number", "minimum": 0}
_STR = {"type": "string"}
_STR_OR_NULL = {"type": ["string", "null"]}
_SHAPE = {"type": "array", "items": _INT}


def _object(properties: dict[str, Any], optional: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": [k for k in properties if k not in optional],
        "additionalProperties": False,
    }


def _or_null(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "type": [schema["type"], "null"]}


_MODULE = _object(
    {"module": _STR, "type": _STR, "self_bytes": _INT, "total_bytes": _INT, "tensors": _INT}
)
_TENSOR = _object(
    {
        "bytes": _INT,
        "shape": _SHAPE,
        "dtype": _STR,
        "module": _STR,
        "saved_by": {"type": "array", "items": _STR},
    }
)
_POLICY = _object(
    {
        "label": _STR,
        "policy": {"type": "string", "enum": [*NAMED, BUDGET]},
        "call": _STR,
        "budget_bytes": _INT_OR_NULL,
        "budget_fraction": {"type": ["number", "null"], "minimum": 0},
        "peak_bytes": _INT,
        "predicted_peak_bytes": _INT,
        "peak_ratio": _NUM,
        "step_time_s": _NUM,
        "step_times_s": {"type": "array", "items": _NUM},
        "time_ratio": _NUM,
        "first_step_s": _NUM,
        "recompute_flops": _INT,
        "forward_flops": _INT,
        "kept_tensors": _INT,
        "kept_bytes": _INT,
        "recomputed_ops": _INT,
        "graphs": _INT,
        "recaptured": {"type": "boolean"},
        "offloaded_bytes": _INT,
        "offload_to": _STR_OR_NULL,
        "transfer_seconds": _NUM,
        "stall_seconds": _NUM,
    }
)
_PROBE = _object(
    {"batch": _INT, "total_bytes": _INT_OR_NULL, "fits": {"type": "boolean"}, "error": _STR_OR_NULL}
)
_SEARCH = _object(
    {
        "label": _STR,
        "max_batch": _INT,
        "total_bytes": _INT_OR_NULL,
        "first_not_fitting": _INT_OR_NULL,
        "capped": {"type": "boolean"},
        "probes": {"type": "array", "items": _PROBE},
    }
)

#: JSON Schema of the report written by ``memfit profile --json``.
REPORT_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "memfit profile report",
    **_object(
        {
            "schema": {"type": "string", "enum": [SCHEMA_ID]},
            "memfit_version": _STR,
            "torch_version": _STR,
            "target": _STR,
            "model": _STR,
            "device": _STR,
            "dtype": _STR_OR_NULL,
            "batch_dim": _INT,
            "batch_size": _INT_OR_NULL,
            "parameters": _object({"count": _INT, "bytes": _INT}),
            "buffers_bytes": _INT,
            "inputs": {
                "type": "array",
                "items": _object({"name": _STR, "shape": _SHAPE, "dtype": _STR}),
            },
            "activations": _object(
                {
                    "method": _STR,
                    "total_bytes": _INT,
                    "memfit_none_kept_bytes": _INT_OR_NULL,
                    "by_module": {"type": "array", "items": _MODULE},
                    "largest_tensors": {"type": "array", "items": _TENSOR},
                }
            ),
            "policies": {"type": "array", "items": _POLICY},
            "max_batch": _or_null(
                _object(
                    {
                        "budget_bytes": _INT,
                        "covers": _STR,
                        "batch_step": _INT,
                        "limit": _INT,
                        "results": {"type": "array", "items": _SEARCH},
                    }
                )
            ),
            "pareto": {
                "type": ["array", "null"],
                "items": _object(
                    {"peak_bytes": _INT, "recompute_flops": _INT, "recompute_seconds": _NUM}
                ),
            },
            "figures": _object({"timeline": _STR, "pareto": _STR_OR_NULL}),
        }
    ),
}

_TYPES: dict[str, Any] = {
    "object": dict,
    "array": list,
    "string": str,
    "boolean": bool,
    "null": type(None),
}


def _is(value: Any, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES[kind])


def validate(value: Any, schema: dict[str, Any] = REPORT_SCHEMA, path: str = "$") -> list[str]:
    """Every way ``value`` violates ``schema`` (the keywords listed in the module docstring)."""
    errors: list[str] = []
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if not any(_is(value, k) for k in kinds):
            return [f"{path}: expected {' or '.join(kinds)}, got {type(value).__name__}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} is not one of {schema['enum']}")
    if "minimum" in schema and _is(value, "number") and value < schema["minimum"]:
        errors.append(f"{path}: {value} is below the minimum {schema['minimum']}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", ()):
            if key not in value:
                errors.append(f"{path}: missing required key {key!r}")
        for key, item in value.items():
            if key in props:
                errors.extend(validate(item, props[key], f"{path}.{key}"))
            elif schema.get("additionalProperties", True) is False:
                errors.append(f"{path}: unexpected key {key!r}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors.extend(validate(item, schema["items"], f"{path}[{i}]"))
    return errors


# ------------------------------------------------------------------------- building the report


def _ratio(value: float, base: float) -> float:
    return value / base if base else 0.0


def policy_entry(r: PolicyResult, base: PolicyResult, executor: str = "eager") -> dict[str, Any]:
    """One ``policies`` entry from a ``memfit.cli.steps.PolicyResult`` and the ``none`` result,
    measured with memfit's ``executor``."""
    plan, budget = r.plan, r.policy.budget
    return {
        "label": r.policy.label,
        "policy": r.policy.name,
        "budget_bytes": budget.bytes if budget else None,
        "budget_fraction": budget.fraction if budget else None,
        "call": r.policy.call(executor=executor),
        "peak_bytes": r.peak_bytes,
        "predicted_peak_bytes": int(plan.predicted_peak_bytes),
        "peak_ratio": _ratio(r.peak_bytes, base.peak_bytes),
        "step_time_s": r.step_time,
        "step_times_s": list(r.step_times),
        "time_ratio": _ratio(r.step_time, base.step_time),
        "first_step_s": r.compile_s,
        "recompute_flops": int(plan.recompute_flops),
        "forward_flops": int(plan.forward_flops),
        "kept_tensors": len(plan.kept),
        "kept_bytes": int(plan.kept_bytes),
        "recomputed_ops": len(plan.recomputed),
        "graphs": len(plan.graphs),
        "recaptured": bool(r.recaptured),
        "offloaded_bytes": int(plan.offloaded_bytes),
        "offload_to": plan.offload_to,
        "transfer_seconds": float(plan.transfer_seconds),
        "stall_seconds": float(plan.stall_seconds),
    }


def activations_entry(
    a: Any, method: str, none_kept_bytes: int | None, top: int = 20
) -> dict[str, Any]:
    """The ``activations`` entry from a ``memfit.measurement.activations.Activations``."""
    return {
        "method": method,
        "total_bytes": a.total_bytes,
        "memfit_none_kept_bytes": none_kept_bytes,
        "by_module": [
            {
                "module": m.module,
                "type": m.type,
                "self_bytes": m.self_bytes,
                "total_bytes": m.total_bytes,
                "tensors": m.tensors,
            }
            for m in a.modules
        ],
        "largest_tensors": [
            {
                "bytes": t.bytes,
                "shape": list(t.shape),
                "dtype": t.dtype,
                "module": t.module,
                "saved_by": list(t.saved_by),
            }
            for t in a.tensors[:top]
        ],
    }


def search_entry(s: Any) -> dict[str, Any]:
    """One ``max_batch.results`` entry from a ``memfit.cli.batch_search.SearchResult``."""
    return {
        "label": s.label,
        "max_batch": s.max_batch,
        "total_bytes": s.total_bytes,
        "first_not_fitting": s.first_not_fitting,
        "capped": s.capped,
        "probes": [
            {"batch": p.batch, "total_bytes": p.total_bytes, "fits": p.fits, "error": p.error}
            for p in s.probes
        ],
    }
