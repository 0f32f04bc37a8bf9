"""A Redis client configured the way every process of a run needs it: bounded socket
waits and a retry with exponential back-off when the connection drops (a restarted Redis,
a node moved), so a blip is survived and a dead server is an error within seconds, never
a silent hang. One URL names either a single server or a Redis Cluster (`connect`)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TypeAlias
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from scalerl import private_paths

# What `connect` returns: a single server's client, or a Redis Cluster's (every key of a
# run shares one hash slot, `scalerl.state.keys`, so the state layer uses both alike).
RedisClient: TypeAlias = redis.Redis | RedisCluster
# Every error a command of either client raises: redis-py's cluster errors
# (RedisClusterUnreachableError, a cross-slot command) are not RedisErrors.
REDIS_ERRORS: tuple[type[Exception], ...] = (redis.RedisError, RedisClusterException)
# The URL's query parameter that selects a Redis Cluster: `?cluster=true` (or `false`).
CLUSTER_PARAM = "cluster"
_CLUSTER_VALUES = ("true", "false")

# Above every blocking stream read of the run (`ReplayStream.read` checks its `block_ms`
# against it), so a reply that never comes is a TimeoutError, not a hang.
# Where `scalerl run` hands its children the Redis URL (its password included): the
# environment, readable by this user only, where a command line is readable by everyone.
REDIS_URL_ENV = "SCALERL_REDIS_URL"
# A file holding the password of the URL's user (deploy/: the component's Secret key).
REDIS_PASSWORD_FILE_ENV = "SCALERL_REDIS_PASSWORD_FILE"
SOCKET_TIMEOUT_S = 30.0
# How long a process waits out a Redis that is away (restarting, failing over) before a
# command fails, seconds: SCALERL_REDIS_OUTAGE_S, else 120. Every write a retry may repeat
# is idempotent (`scalerl.state.once`), so waiting is safe.
OUTAGE_ENV = "SCALERL_REDIS_OUTAGE_S"
DEFAULT_OUTAGE_S = 120.0
_BACKOFF_BASE_S = 0.1
_BACKOFF_CAP_S = 2.0


def outage_retries(outage_s: float) -> int:
    """Retries whose back-off (0.1, 0.2, 0.4, 0.8, 1.6, then 2 s each) adds up to at least
    `outage_s` seconds (0 for 0)."""
    retries, waited = 0, 0.0
    while waited < outage_s:
        waited += min(_BACKOFF_CAP_S, _BACKOFF_BASE_S * 2**retries)
        retries += 1
    return retries


def _retry(retries: int) -> Retry:
    """Back-off retries of dropped connections and timeouts, never of a refused password
    (redis-py's AuthenticationError is a ConnectionError: waiting cannot fix it)."""
    backoff = ExponentialBackoff(cap=_BACKOFF_CAP_S, base=_BACKOFF_BASE_S)
    try:
        return Retry(backoff, retries, is_retryable=_not_refused)
    except TypeError:  # a redis-py without is_retryable: every connection error retried
        return Retry(backoff, retries)


def _not_refused(error: Exception) -> bool:
    return not isinstance(error, redis.AuthenticationError)


def outage_s_from_env() -> float:
    """SCALERL_REDIS_OUTAGE_S, else 120. Raises ValueError naming it when it is not a
    number in [0, 3600]."""
    text_value = os.environ.get(OUTAGE_ENV, "")
    if not text_value:
        return DEFAULT_OUTAGE_S
    try:
        value = float(text_value)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 3600:
        raise ValueError(f"{OUTAGE_ENV} must be seconds in [0, 3600], got {text_value!r}")
    return value


def connect(
    url: str,
    *,
    connect_timeout_s: float = 5.0,
    socket_timeout_s: float = SOCKET_TIMEOUT_S,
    retries: int | None = None,
) -> RedisClient:
    """A client for `url` returning raw bytes (values are protobufs).

    `url` is redis://[[user]:password@]host:port[/db], or rediss:// for TLS. With the
    query parameter `cluster=true` (e.g. redis://:pw@redis-0.example:6379/0?cluster=true)
    it names one node of a Redis Cluster, and the client is a `redis.cluster.RedisCluster`
    that discovers the others and routes each command to the master of its key's slot;
    the db must then be 0. `cluster=false`, or no parameter, is a single server. The
    parameter is taken out before the URL reaches redis-py.

    Connecting gives up after `connect_timeout_s` seconds and a reply after
    `socket_timeout_s` seconds (blocking stream reads wait their own `block_ms`, which
    must stay below it); a connection or timeout error is retried `retries` times with
    exponential back-off (redis-py's Retry) before it is raised: by default as many as
    wait out the outage SCALERL_REDIS_OUTAGE_S allows (120 s), so a Redis restart pauses
    the run instead of crashing it. A cluster client reads the cluster's layout when it
    is made, retried the same way while no node answers (then redis.ConnectionError);
    once made, it gives up early only when no node of the cluster answers at all
    (RedisClusterUnreachableError), where a failover of one master is waited out.

    Raises ValueError for a timeout <= 0, retries < 0, a bad SCALERL_REDIS_OUTAGE_S, a
    `cluster` value other than true or false, or a cluster URL with a db other than 0;
    redis.ConnectionError when a cluster's nodes stay unreachable.
    """
    if retries is None:
        retries = outage_retries(outage_s_from_env())
    for name, value in (
        ("connect_timeout_s", connect_timeout_s),
        ("socket_timeout_s", socket_timeout_s),
    ):
        if not value > 0:
            raise ValueError(f"{name} must be > 0 seconds, got {value!r}")
    if retries < 0:
        raise ValueError(f"retries must be >= 0, got {retries!r}")
    server_url, cluster = split_cluster_flag(url)
    timeouts = {"socket_connect_timeout": connect_timeout_s, "socket_timeout": socket_timeout_s}
    if cluster:
        return _connect_cluster(server_url, retries, timeouts)
    return redis.Redis.from_url(
        server_url,
        decode_responses=False,
        retry=_retry(retries),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        health_check_interval=30,
        **timeouts,
    )


def _connect_cluster(url: str, retries: int, timeouts: dict[str, float]) -> RedisCluster:
    """A RedisCluster for the node at `url`, its first read of the cluster's slots retried
    with `connect`'s back-off (redis-py raises at once when no node answers)."""
    path = urlsplit(url).path.strip("/")
    if path not in ("", "0"):
        raise ValueError(f"a Redis Cluster URL's db must be 0, got {path!r} in {redact_url(url)}")
    backoff = ExponentialBackoff(cap=_BACKOFF_CAP_S, base=_BACKOFF_BASE_S)
    failures = 0
    while True:
        try:
            return RedisCluster.from_url(
                url, decode_responses=False, retry=_retry(retries), **timeouts
            )
        except (RedisClusterException, redis.ConnectionError, redis.TimeoutError) as exc:
            if isinstance(exc, redis.AuthenticationError) or failures >= retries:
                raise redis.ConnectionError(
                    f"Redis Cluster at {redact_url(url)}: no node answered: {exc}"
                ) from exc
        failures += 1
        time.sleep(backoff.compute(failures))  # as redis-py's Retry waits


def check_redis_url(url: str) -> str:
    """Return `url` unchanged if `connect` can dial it: redis:// or rediss://, a host, a
    port in 1-65535 when given, and a valid `cluster` flag. Raises ValueError saying what
    is wrong (the password redacted)."""
    form = "redis[s]://[[user]:password@]host[:port][/db][?cluster=true]"
    parts = urlsplit(url)
    try:
        port_ok = parts.port is None or parts.port > 0
    except ValueError:  # not a number, or above 65535
        port_ok = False
    if parts.scheme not in ("redis", "rediss") or not parts.hostname or not port_ok:
        raise ValueError(f"must look like {form}, got {redact_url(url)!r}")
    split_cluster_flag(url)
    return url


def split_cluster_flag(url: str) -> tuple[str, bool]:
    """(`url` without its `cluster` query parameter, whether it was `true`). Raises
    ValueError naming the parameter when it is given twice or is not true or false."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    values = [value for name, value in query if name == CLUSTER_PARAM]
    if not values:
        return url, False
    if len(values) > 1 or values[0].lower() not in _CLUSTER_VALUES:
        raise ValueError(
            f"Redis URL parameter {CLUSTER_PARAM} must be one of {', '.join(_CLUSTER_VALUES)}, "
            f"got {', '.join(map(repr, values))}"
        )
    rest = urlencode([(name, value) for name, value in query if name != CLUSTER_PARAM])
    return urlunsplit(parts._replace(query=rest)), values[0].lower() == "true"


def socket_timeout_s(client: RedisClient) -> float | None:
    """The reply timeout of `client`'s connections (each node's, for a cluster), seconds
    (None: none set)."""
    timeout: float | None = client.get_connection_kwargs().get("socket_timeout")
    return timeout


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


def split_password(url: str) -> tuple[str, str]:
    """(`url` without its password, the password decoded; "" when it has none). The user
    stays: an ACL user's password goes back in with `with_password`."""
    parts = urlsplit(url)
    if parts.password is None:
        return url, ""
    user = quote(parts.username or "", safe="")
    host = parts.netloc.rpartition("@")[2]
    netloc = f"{user}@{host}" if user else host
    return urlunsplit(parts._replace(netloc=netloc)), unquote(parts.password)


def take_redis_url(flag: str | None) -> str | None:
    """The Redis URL a service dials: `--redis-url` when given, else SCALERL_REDIS_URL,
    which is then removed from this process's environment so that the processes it
    starts (verifier workers running model-written programs among them) do not inherit
    the password. With SCALERL_REDIS_PASSWORD_FILE (a mounted Secret, as in deploy/), the
    password is read from that file into the URL (whose user names the ACL user). None
    when no URL is set.

    Raises ValueError naming SCALERL_REDIS_PASSWORD_FILE when it cannot be read or is
    empty (an empty secret never means "no password")."""
    from_env = os.environ.pop(REDIS_URL_ENV, None)
    url = flag or from_env or None
    path = os.environ.get(REDIS_PASSWORD_FILE_ENV, "")
    if url is None or not path:
        return url
    try:
        password = Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"{REDIS_PASSWORD_FILE_ENV}: cannot read {path}: {exc.strerror}") from None
    private_paths.register(path)
    if not password:
        raise ValueError(f"{REDIS_PASSWORD_FILE_ENV}: {path} is empty")
    return with_password(url, password)


def with_password(url: str, password: str) -> str:
    """`url` with `password` in it (replacing any), its user kept."""
    parts = urlsplit(url)
    user = quote(parts.username or "", safe="")
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:{quote(password, safe='')}@{host}"))
