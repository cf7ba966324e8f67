"""OSS credentials and endpoint: explicit values (CLI flags) first, then the environment.

Environment variables (oss2's standard names; in systemd put them in an ``EnvironmentFile=``):

* ``OSS_ACCESS_KEY_ID``, ``OSS_ACCESS_KEY_SECRET``: the AccessKey pair;
* ``OSS_SESSION_TOKEN``: optional STS token (temporary credentials);
* ``OSS_ENDPOINT``: e.g. ``https://oss-cn-hangzhou.aliyuncs.com`` or, for a test double,
  ``http://127.0.0.1:PORT`` (an IP endpoint is addressed path-style by ``oss2``).

The secret and the token never appear in ``repr``, logs, ``/status`` or error messages.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Optional

ENV_ACCESS_KEY_ID = "OSS_ACCESS_KEY_ID"
ENV_ACCESS_KEY_SECRET = "OSS_ACCESS_KEY_SECRET"
ENV_SESSION_TOKEN = "OSS_SESSION_TOKEN"
ENV_ENDPOINT = "OSS_ENDPOINT"


class OssCredentialsError(ValueError):
    """OSS is used but the credentials or the endpoint are missing."""


@dataclass(frozen=True)
class OssCredentials:
    """What a client needs to reach OSS.

    Attributes:
        access_key_id: the AccessKey id (not secret; shown in logs as is).
        access_key_secret: the AccessKey secret (never shown).
        endpoint: the service endpoint URL.
        security_token: an STS token, "" for long-term keys (never shown).
    """

    access_key_id: str
    access_key_secret: str = field(repr=False)
    endpoint: str
    security_token: str = field(default="", repr=False)

    def describe(self) -> str:
        """A line safe for logs: the endpoint and the key id, no secret."""
        sts = ", STS token" if self.security_token else ""
        return f"endpoint {self.endpoint}, AccessKey id {self.access_key_id}{sts}"


_lock = threading.Lock()
_explicit: dict[str, str] = {}


def configure_oss(access_key_id: str = "", access_key_secret: str = "", endpoint: str = "",
                  security_token: str = "") -> None:
    """Sets credentials for this process (e.g. from ``odl-export --oss_ak/--oss_sk``).

    Empty values leave the environment's in effect.

    Args:
        access_key_id: AccessKey id.
        access_key_secret: AccessKey secret.
        endpoint: endpoint URL.
        security_token: STS token.
    """
    with _lock:
        for k, v in (("id", access_key_id), ("secret", access_key_secret),
                     ("endpoint", endpoint), ("token", security_token)):
            if v:
                _explicit[k] = v


def reset_oss_configuration() -> None:
    """Forgets what :func:`configure_oss` set (the environment applies again)."""
    with _lock:
        _explicit.clear()


def oss_credentials(env: Optional[dict[str, str]] = None) -> OssCredentials:
    """The credentials in effect: :func:`configure_oss` values, else the environment.

    Args:
        env: the environment to read (default ``os.environ``).

    Returns:
        The credentials.

    Raises:
        OssCredentialsError: naming what is missing (never a value).
    """
    env = os.environ if env is None else env
    with _lock:
        explicit = dict(_explicit)
    key_id = explicit.get("id") or env.get(ENV_ACCESS_KEY_ID, "")
    secret = explicit.get("secret") or env.get(ENV_ACCESS_KEY_SECRET, "")
    endpoint = explicit.get("endpoint") or env.get(ENV_ENDPOINT, "")
    token = explicit.get("token") or env.get(ENV_SESSION_TOKEN, "")
    missing = []
    if not key_id:
        missing.append(f"the AccessKey id ({ENV_ACCESS_KEY_ID} or --oss_ak)")
    if not secret:
        missing.append(f"the AccessKey secret ({ENV_ACCESS_KEY_SECRET} or --oss_sk)")
    if not endpoint:
        missing.append(f"the endpoint ({ENV_ENDPOINT} or --oss_endpoint)")
    if missing:
        raise OssCredentialsError("oss:// paths need " + ", ".join(missing))
    return OssCredentials(key_id, secret, endpoint.rstrip("/"), token)
