"""Key files: reading and writing an :class:`~prefixmesh.overlay.core.identity.Identity`.

The format (one JSON line, mode 0600) is described in ``overlay/core/identity.py``; this
module is the IO half, kept out of the pure core.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from pathlib import Path

from .core.identity import (
    _KEY_TYPE_ED25519,
    ED25519_SEED_BYTES,
    KEY_FILE_TYPE,
    KEY_FILE_VERSION,
    MAX_KEY_FILE_BYTES,
    Identity,
    InsecureKeyFile,
    KeyFileExists,
    KeyFileNotFound,
    MalformedKeyFile,
    OversizeKeyFile,
    UnsupportedKeyType,
)
from .privatefile import (
    InsecureFileMode,
    NotARegularFile,
    OversizeFile,
    PrivateFileNotFound,
    PrivateFileUnreadable,
    read_private_file,
)

__all__ = ["save_identity", "load_identity"]


def _encode_key_file(identity: Identity) -> bytes:
    doc = {
        "type": KEY_FILE_TYPE,
        "version": KEY_FILE_VERSION,
        "key_type": _KEY_TYPE_ED25519,
        "seed": base64.b64encode(identity.seed_bytes()).decode("ascii"),
        "peer_id": identity.peer_id_b58,
    }
    return (json.dumps(doc, separators=(", ", ": ")) + "\n").encode("utf-8")


def save_identity(
    identity: Identity, path: str | os.PathLike[str], *, overwrite: bool = False
) -> None:
    """Write ``identity`` to ``path`` atomically with mode 0600.

    The content goes to a temporary file in the same directory (created 0600, so the
    seed is never readable by others even briefly), is fsynced, then moved into place:
    a crash leaves either no file or a complete one. Without ``overwrite`` an existing
    file raises :class:`KeyFileExists` (checked atomically: ``link`` fails if it exists).
    Missing parent directories are created with mode 0700.
    """
    path = Path(path)
    parent = path.parent
    missing = []
    ancestor = parent
    while not ancestor.exists():
        missing.append(ancestor)
        ancestor = ancestor.parent
    for directory in reversed(missing):  # every directory we create is private
        directory.mkdir(mode=0o700, exist_ok=True)
        os.chmod(directory, 0o700)  # mkdir's mode is filtered by the umask
    if not overwrite and path.exists():
        raise KeyFileExists(f"{path}: key file already exists (refusing to overwrite)")
    content = _encode_key_file(identity)
    tmp = parent / f".{path.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, content)
            os.fsync(fd)
        finally:
            os.close(fd)
        if overwrite:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise KeyFileExists(
                    f"{path}: key file already exists (refusing to overwrite)"
                ) from None
            os.unlink(tmp)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    try:  # make the rename durable
        dir_fd = os.open(parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def load_identity(path: str | os.PathLike[str]) -> Identity:
    """Read a key file written by :func:`save_identity`.

    Raises (all :class:`IdentityError`): :class:`KeyFileNotFound`; :class:`InsecureKeyFile`
    if it is not a regular file or group/others have any access (fix: ``chmod 600 PATH``);
    :class:`OversizeKeyFile`; :class:`MalformedKeyFile` for bad JSON, missing or
    mistyped fields, a truncated seed, or a peer id that does not match the seed;
    :class:`UnsupportedKeyType` for an unknown file type, version or key type.
    """
    path = Path(path)
    try:
        content = read_private_file(path, MAX_KEY_FILE_BYTES)
    except PrivateFileNotFound:
        raise KeyFileNotFound(f"{path}: key file not found") from None
    except PrivateFileUnreadable as exc:
        raise InsecureKeyFile(f"{path}: cannot open key file: {exc.strerror}") from None
    except NotARegularFile:
        raise InsecureKeyFile(f"{path}: key file is not a regular file") from None
    except InsecureFileMode as exc:
        raise InsecureKeyFile(
            f"{path}: key file is accessible by group or others "
            f"(mode {exc.mode:04o}); fix with: chmod 600 {path}"
        ) from None
    except OversizeFile as exc:
        if exc.size is not None:
            raise OversizeKeyFile(
                f"{path}: key file is {exc.size} bytes, more than the "
                f"{MAX_KEY_FILE_BYTES}-byte limit; is this the right file?"
            ) from None
        raise OversizeKeyFile(
            f"{path}: key file exceeds the {MAX_KEY_FILE_BYTES}-byte limit"
        ) from None
    return _parse_key_file(content, path)


def _parse_key_file(content: bytes, path: Path) -> Identity:
    try:
        doc = json.loads(content.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise MalformedKeyFile(f"{path}: key file is not valid JSON ({exc})") from None
    except RecursionError:  # json recurses per nesting level; a key file is flat
        raise MalformedKeyFile(f"{path}: key file is not valid JSON (nested too deeply)") from None
    if not isinstance(doc, dict):
        raise MalformedKeyFile(f"{path}: key file must hold a JSON object")
    if doc.get("type") != KEY_FILE_TYPE:
        raise UnsupportedKeyType(
            f"{path}: not a prefixmesh identity file (type {doc.get('type')!r}, "
            f"expected {KEY_FILE_TYPE!r})"
        )
    version = doc.get("version")
    # 1.0 == 1 and True == 1 in Python: insist on the JSON integer itself
    if type(version) is not int or version != KEY_FILE_VERSION:
        raise UnsupportedKeyType(
            f"{path}: unsupported key file version {doc.get('version')!r} "
            f"(this code reads version {KEY_FILE_VERSION})"
        )
    if doc.get("key_type") != _KEY_TYPE_ED25519:
        raise UnsupportedKeyType(
            f"{path}: unsupported key type {doc.get('key_type')!r} (only 'ed25519')"
        )
    seed_text = doc.get("seed")
    if not isinstance(seed_text, str):
        raise MalformedKeyFile(f"{path}: key file lacks a 'seed' string")
    try:
        seed = base64.b64decode(seed_text, validate=True)
    except (binascii.Error, ValueError):
        raise MalformedKeyFile(f"{path}: 'seed' is not valid base64") from None
    if len(seed) != ED25519_SEED_BYTES:
        raise MalformedKeyFile(
            f"{path}: 'seed' is {len(seed)} bytes, expected {ED25519_SEED_BYTES} (truncated?)"
        )
    identity = Identity.from_seed(seed)
    recorded = doc.get("peer_id")
    if recorded is not None and recorded != identity.peer_id_b58:
        raise MalformedKeyFile(
            f"{path}: recorded peer_id {recorded!r} does not match the seed's "
            f"{identity.peer_id_b58} (corrupted file?)"
        )
    return identity
