"""node/mesh_models.py: the gateway's view of the mesh's models, called directly with two
kinds of backend (one that knows only its own model ids, one with the node's catalog over
overlay/core/models.py): the ``GET /v1/models`` list, ``GET /v1/models/{name}`` and the
fingerprint a request's ``model`` puts in the job. The same over real HTTP:
tests/node/test_models_gateway.py."""

from __future__ import annotations

from prefixmesh.node.mesh_models import job_model, model_json, models_json
from prefixmesh.overlay.core import models

LOCAL = "local-model"
FP_LOCAL, FP_B, FP_C = b"\xaa" * 16, b"\xbb" * 16, b"\xcc" * 16


class OwnModelOnly:
    """A backend without a catalog: it knows its model's ids, nothing of the mesh."""

    def model_ids(self):
        return [LOCAL, models.LOCAL_ALIAS]


class MeshBackend(OwnModelOnly):
    """A backend whose node sees these (fingerprint, name) announcements from up peers."""

    def __init__(self, peers):
        self.peers = peers

    def model_catalog(self):
        return models.catalog((FP_LOCAL, LOCAL), self.peers)

    def resolve_model(self, name):
        return models.resolve(name, self.model_catalog())


def _ids(listing):
    return [(m["id"], m.get("prefixmesh", {}).get("nodes")) for m in listing["data"]]


def test_a_backend_without_a_catalog_lists_and_accepts_only_its_own_ids():
    b = OwnModelOnly()
    assert _ids(models_json(b)) == [(LOCAL, None), (models.LOCAL_ALIAS, None)]
    assert all(m["object"] == "model" for m in models_json(b)["data"])
    assert job_model(b, LOCAL) == b"" and job_model(b, models.LOCAL_ALIAS) == b""
    assert job_model(b, "other-model") is None
    assert model_json(b, LOCAL)["id"] == LOCAL
    assert model_json(b, "other-model") is None


def test_the_mesh_list_has_the_local_ids_then_peers_models_by_node_count():
    b = MeshBackend([(FP_B, "model-b")] + [(FP_C, "model-c")] * 3 + [(FP_LOCAL, LOCAL)])
    data = models_json(b)["data"]
    # local first (this node + the one peer that also serves it), then most nodes first
    assert _ids({"data": data}) == [(LOCAL, 2), (models.LOCAL_ALIAS, 2), ("model-c", 3),
                                    ("model-b", 1)]
    assert [m["prefixmesh"]["local"] for m in data] == [True, True, False, False]
    assert [m["prefixmesh"]["fingerprint"] for m in data] == \
        [FP_LOCAL.hex(), FP_LOCAL.hex(), FP_C.hex(), FP_B.hex()]


def test_a_peer_model_whose_name_is_taken_is_listed_under_its_fingerprint():
    # a peer announces another model under the local model's name: both stay reachable
    b = MeshBackend([(FP_B, LOCAL)])
    assert [m["id"] for m in models_json(b)["data"]] == [LOCAL, models.LOCAL_ALIAS,
                                                          FP_B.hex()]
    assert job_model(b, LOCAL) == b""  # the name is this node's model
    assert job_model(b, FP_B.hex()) == FP_B  # the fingerprint is the peer's


def test_job_model_resolves_names_fingerprints_and_prefixes():
    b = MeshBackend([(FP_B, "model-b"), (FP_C, "model-c")])
    assert job_model(b, "model-b") == FP_B
    assert job_model(b, FP_C.hex()) == FP_C
    assert job_model(b, FP_C.hex()[: models.MIN_FP_PREFIX_HEX]) == FP_C
    assert job_model(b, FP_C.hex()[: models.MIN_FP_PREFIX_HEX - 1]) is None  # too short
    assert job_model(b, FP_LOCAL.hex()) == b""  # our own model by fingerprint
    assert job_model(b, "no-such-model") is None
    assert job_model(b, 42) is None  # not a string: no model


def test_model_json_finds_the_listed_object_by_id_fingerprint_or_prefix():
    b = MeshBackend([(FP_B, "model-b")])
    for name in ("model-b", FP_B.hex(), FP_B.hex()[:10]):
        assert model_json(b, name)["id"] == "model-b", name
    assert model_json(b, models.LOCAL_ALIAS)["id"] == models.LOCAL_ALIAS  # listed as such
    for name in (LOCAL, FP_LOCAL.hex(), FP_LOCAL.hex()[:10]):
        assert model_json(b, name)["id"] == LOCAL, name
    assert model_json(b, "no-such-model") is None
