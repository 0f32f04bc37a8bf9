"""A Redis client configured the way every process of a run needs it."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import redis


def connect(url: str, *, connect_timeout_s: float = 5.0) -> redis.Redis:
    """A client for `url` (redis://[:password@]host:port/db, or rediss:// for TLS) returning
    raw bytes (values are protobufs).

    No read timeout is set because stream reads block on purpose (bounded by their own
    `block_ms`); connecting gives up after `connect_timeout_s` seconds.
    """
    return redis.Redis.from_url(
        url,
        decode_responses=False,
        socket_connect_timeout=connect_timeout_s,
        health_check_interval=30,
    )


def text(value: bytes | str) -> str:
    """A Redis reply value as str (the clients return bytes: values are protobufs)."""
    return value.decode() if isinstance(value, bytes) else value


def redact_url(url: str) -> str:
    """`url` with its password replaced by '***', for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = f"{parts.username}:" if parts.username else ":"
    host = parts.hostname or ""
    netloc = f"{user}***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))
