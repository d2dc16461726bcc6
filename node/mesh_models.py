"""The gateway's view of the mesh's models (issue 18): what ``GET /v1/models`` lists and
which model a request's ``model`` field names, for the OpenAI API (``http_gateway``) and
the Ollama API (``ollama_api``) alike. ``backend`` is a ``GatewayBackend``; one with
``model_catalog()`` / ``resolve_model(name)`` (the node's, over ``core/models.py``) knows
the mesh, one without knows only its own ``model_ids()``."""

from __future__ import annotations

from typing import Any

from .openai_schema import catalog_models_object, models_object

__all__ = ["job_model", "model_json", "models_json"]


def models_json(backend) -> dict[str, Any]:
    """``GET /v1/models``: this node's model under its ids (its name, the alias), then the
    mesh's other models by name (by fingerprint where a name is taken), each with its
    fingerprint and how many nodes serve it now."""
    catalog = getattr(backend, "model_catalog", None)
    if catalog is None:  # a backend that knows only its own model
        return models_object(backend.model_ids())
    rows: list[tuple[str, str, int, bool]] = []
    taken: set[str] = set()
    for e in catalog():
        for model_id in (backend.model_ids() if e.local else [e.name]):
            model_id = e.fp_hex if model_id in taken else model_id
            taken.add(model_id)
            rows.append((model_id, e.fp_hex, e.nodes, e.local))
    return catalog_models_object(rows)


def model_json(backend, name: str) -> dict[str, Any] | None:
    """``GET /v1/models/{name}``: the listed object ``name`` is the id of, else the one of
    the model it names (a fingerprint, a hex prefix); None: no such model now."""
    listed = models_json(backend)["data"]
    found = next((m for m in listed if m["id"] == name), None)
    fp = job_model(backend, name) if found is None else None
    if fp is not None:
        want = fp.hex() if fp else None
        found = next((m for m in listed if (m.get("prefixmesh", {}).get("fingerprint") == want
                      if want else m["id"] in backend.model_ids())), None)
    return found


def job_model(backend, name: str) -> bytes | None:
    """The fingerprint of the model a request names when it is another node's (b"": this
    node's own), or None when no node of the mesh serves it now."""
    if name in backend.model_ids():
        return b""
    resolve = getattr(backend, "resolve_model", None)
    entry = resolve(name) if resolve is not None and isinstance(name, str) else None
    if entry is None:
        return None
    return b"" if entry.local else bytes(entry.fingerprint)
