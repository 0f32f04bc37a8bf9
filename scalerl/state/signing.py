"""Signed entries: what in Redis makes a process dial someone carries an HMAC made with
the run's secret, so that whoever can write Redis cannot send a process (with its
weights or prompts) to an address of their choosing.

Two entries are signed: a worker's registry entry (its address; the learner dials it
to push weights and evaluate) and the published weights' record
(`latest_weights`: its `source` is the learner a worker fetches from). The key is derived
from the run's token (`scalerl.rpc.security`), which only the run's processes
hold; a run without a token (auth off, the laptop default binding 127.0.0.1) signs
nothing and checks nothing. An entry that fails the check is ignored, logged once.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)
_CONTEXT = b"scalerl signed redis entries v1"
SIG_FIELD = "sig"


class EntrySigner:
    """Signs and checks entries with a key derived from `token` ("" = off: every entry
    passes unsigned)."""

    def __init__(self, token: str) -> None:
        self._key = hmac.new(token.encode(), _CONTEXT, hashlib.sha256).digest() if token else b""
        self._refused: set[str] = set()

    @property
    def enabled(self) -> bool:
        return bool(self._key)

    def sign(self, kind: str, name: str, fields: Mapping[str, Any]) -> str:
        """The hex HMAC-SHA256 of (kind, name, fields), fields as canonical JSON. kind and
        name bind the signature to one entry (a worker's id, a run's id), so a genuine
        value cannot be replayed under another. "" when off."""
        if not self._key:
            return ""
        message = json.dumps([kind, name, fields], sort_keys=True, separators=(",", ":"))
        return hmac.new(self._key, message.encode(), hashlib.sha256).hexdigest()

    def verify(self, kind: str, name: str, fields: Mapping[str, Any], sig: object) -> bool:
        """True when off, or when `sig` is the signature of the entry; a refused entry is
        logged once per (kind, name)."""
        if not self._key:
            return True
        ok = isinstance(sig, str) and hmac.compare_digest(sig, self.sign(kind, name, fields))
        if not ok and f"{kind}:{name}" not in self._refused:
            self._refused.add(f"{kind}:{name}")
            log.warning(
                "%s %s in Redis is not signed with the run's secret: ignored (a process "
                "with write access to Redis that is not of this run?)",
                kind,
                name,
            )
        return ok


def process_signer() -> EntrySigner:
    """The signer of this process's run: keyed by its token
    (`scalerl.rpc.security.current`)."""
    from scalerl.rpc.security import current

    return EntrySigner(current().token)
