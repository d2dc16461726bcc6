"""The gateway's side of many models in one mesh (issue 18), against a scripted backend:
GET /v1/models lists the mesh's models with node counts, a request's model resolves by
name, alias or fingerprint into the job, an unknown model is OpenAI's 404."""

from __future__ import annotations

import httpx
from _gateway import MODEL, FakeBackend, running

from prefixmesh.node.http_gateway import _api_error
from prefixmesh.overlay.core import models, wire

FP_A, FP_B = b"\xaa" * 16, b"\xbb" * 16


class MeshBackend(FakeBackend):
    """FakeBackend whose node sees a second model served by two peers."""

    def model_catalog(self):
        return models.catalog((FP_A, MODEL), [(FP_B, "other-model")] * 2)

    def resolve_model(self, name):
        return models.resolve(name, self.model_catalog())


def _chat(gw, model):
    return httpx.post(gw.url + "/v1/chat/completions", timeout=10, json={
        "model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})


def test_models_lists_the_mesh_with_counts_and_resolves_names_and_fingerprints():
    with running(MeshBackend()) as (gw, backend):
        data = httpx.get(gw.url + "/v1/models", timeout=10).json()["data"]
        assert [(m["id"], m["prefixmesh"]["nodes"], m["prefixmesh"]["local"]) for m in data] \
            == [(MODEL, 1, True), ("prefixmesh", 1, True), ("other-model", 2, False)]
        assert data[2]["prefixmesh"]["fingerprint"] == FP_B.hex()
        for name in ("other-model", FP_B.hex(), FP_B.hex()[:10]):
            assert httpx.get(f"{gw.url}/v1/models/{name}", timeout=10).json()["id"] == \
                "other-model"
        for name, fp in ((MODEL, b""), ("prefixmesh", b""), ("other-model", FP_B),
                         (FP_B.hex()[:12], FP_B), (FP_A.hex(), b"")):
            r = _chat(gw, name)
            assert r.status_code == 200, r.text
            assert backend.jobs[-1].model == fp
            assert r.json()["model"] == name  # echoed as the client named it
        r = _chat(gw, "no-such-model")
        assert r.status_code == 404
        assert r.json()["error"]["code"] == "model_not_found"
        assert r.json()["error"]["param"] == "model"
        assert httpx.get(gw.url + "/v1/models/no-such-model", timeout=10).status_code == 404


def test_a_backend_that_knows_only_its_model_lists_it_as_before():
    with running(FakeBackend()) as (gw, _):
        data = httpx.get(gw.url + "/v1/models", timeout=10).json()["data"]
        assert [m["id"] for m in data] == [MODEL, "prefixmesh"]


def test_the_wire_unknown_model_error_is_a_404_model_not_found():
    err = _api_error(wire.Error("unknown_model", "no node serves it"))
    assert err.status == 404 and err.code == "model_not_found" and err.param == "model"


def test_a_raw_prompt_for_another_model_goes_in_the_job_as_text():
    """``/v1/completions`` and Ollama's raw ``/api/generate`` naming another model of the
    mesh: the job carries the prompt text and that model (its node tokenizes it)."""
    with running(MeshBackend()) as (gw, backend):
        r = httpx.post(gw.url + "/v1/completions", timeout=10, json={
            "model": "other-model", "max_tokens": 2, "prompt": "Once upon a time"})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "other-model"
        job = backend.jobs[-1]
        assert (job.prompt, job.model, job.messages) == ("Once upon a time", FP_B, ())
        r = httpx.post(gw.url + "/api/generate", timeout=10, json={
            "model": "other-model", "prompt": "Once upon", "raw": True, "stream": False})
        assert r.status_code == 200, r.text
        assert (backend.jobs[-1].prompt, backend.jobs[-1].model) == ("Once upon", FP_B)
        r = httpx.post(gw.url + "/v1/completions", timeout=10, json={
            "model": "no-such-model", "max_tokens": 2, "prompt": "Once"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_a_prompt_of_token_ids_is_refused_for_another_model():
    """Token ids are our model's vocabulary: for another model's node they are a 400 naming
    ``prompt`` (text is what travels to it); for ours they go in the job as they are."""
    with running(MeshBackend()) as (gw, backend):
        r = httpx.post(gw.url + "/v1/completions", timeout=10, json={
            "model": "other-model", "max_tokens": 2, "prompt": [1, 2, 3]})
        assert r.status_code == 400
        assert (r.json()["error"]["param"], r.json()["error"]["code"]) == \
            ("prompt", "unsupported_value")
        assert backend.jobs == []
        r = httpx.post(gw.url + "/v1/completions", timeout=10, json={
            "model": MODEL, "max_tokens": 2, "prompt": [[1, 2, 3]]})
        assert r.status_code == 200, r.text
        assert (backend.jobs[-1].prompt, backend.jobs[-1].model) == ((1, 2, 3), b"")
