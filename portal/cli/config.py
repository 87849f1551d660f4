"""Contexts (server + token) in ``$ORRERY_CONFIG`` or ``~/.config/orrery/config.yaml``."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import yaml


class ConfigError(Exception):
    """The CLI is not configured enough to talk to a server."""


@dataclass(frozen=True)
class Context:
    name: str
    server: str
    token: str


def config_path() -> Path:
    if explicit := os.environ.get("ORRERY_CONFIG"):
        return Path(explicit)
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "orrery" / "config.yaml"


def load() -> dict:
    path = config_path()
    if not path.exists():
        return {"contexts": {}, "current-context": None}
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from None
    data.setdefault("contexts", {})
    return data


def save_context(name: str, server: str, token: str) -> Path:
    """Store a context and make it current. The file holds a secret: it is written 0600."""
    data = load()
    data["contexts"][name] = {"server": server.rstrip("/"), "token": token}
    data["current-context"] = name
    path = config_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        yaml.safe_dump(data, handle, sort_keys=True)
    return path


def resolve(server: str | None, token: str | None, context: str | None) -> Context:
    """Flags win over ``ORRERY_SERVER``/``ORRERY_TOKEN``, which win over the config file."""
    data = load()
    name = context or data.get("current-context")
    stored = data["contexts"].get(name, {}) if name else {}
    if context and not stored:
        raise ConfigError(f"no context '{context}' in {config_path()}")
    server = server or os.environ.get("ORRERY_SERVER") or stored.get("server")
    token = token or os.environ.get("ORRERY_TOKEN") or stored.get("token")
    if not server or not token:
        raise ConfigError("not logged in: run 'orrery login --server URL --token TOKEN'")
    return Context(name or "(flags)", server.rstrip("/"), token)
