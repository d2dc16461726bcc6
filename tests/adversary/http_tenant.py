"""HTTP tenant header without a key (issue 14, finding 4), as an outsider would write it.

A raw TCP socket speaks HTTP/1.1 to the gateway on loopback: a chat completion naming a
private tenant in ``x-prefixmesh-tenant`` and no ``Authorization`` header. Before the fix
a gateway with no API key configured served it (any local program could use a private
namespace without its secret). Nothing here imports prefixmesh.
"""

from __future__ import annotations

import json
import socket


def post(host: str, port: int, path: str, body: dict, headers: dict[str, str] | None = None,
         timeout_s: float = 30.0) -> tuple[int, dict]:
    """One HTTP/1.1 POST with ``Connection: close``; returns (status, parsed JSON body)."""
    payload = json.dumps(body).encode()
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}",
             "Content-Type: application/json", f"Content-Length: {len(payload)}",
             "Connection: close"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    raw = ("\r\n".join(lines) + "\r\n\r\n").encode() + payload
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        sock.sendall(raw)
        chunks = []
        while True:
            data = sock.recv(65536)
            if not data:
                break
            chunks.append(data)
    head, _, rest = b"".join(chunks).partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in head.lower():
        rest = _dechunk(rest)
    return status, json.loads(rest)


def _dechunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out, data = out + data[:size], data[size + 2:]
    return out


def use_private_tenant(host: str, port: int, tenant: str) -> tuple[int, dict]:
    """The attack: name a private tenant, present no key."""
    return post(host, port, "/v1/chat/completions",
                {"model": "prefixmesh", "max_tokens": 2,
                 "messages": [{"role": "user", "content": "hello"}]},
                {"x-prefixmesh-tenant": tenant})
