"""`PDCLUSTER_*` environment variables: overrides of any field of the deploy YAML (pydantic-settings parses them).

`PDCLUSTER_<SECTION>__<FIELD>` sets `section.field` (`PDCLUSTER_ROUTER__PORT=50052`,
`PDCLUSTER_PREFILL__REPLICAS=2`, `PDCLUSTER_TRACING__OTLP_ENDPOINT=http://otel:4317`); a top-level field drops the
section (`PDCLUSTER_MODEL=/models/x.gguf`); lists and mappings are JSON (`PDCLUSTER_PREFILL__RESOURCES='{"a": 1}'`).
Names are case-insensitive. The YAML stays the full form: the environment only changes what it names.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, create_model
from pydantic_settings import BaseSettings, EnvSettingsSource

PREFIX = "PDCLUSTER_"
DELIMITER = "__"
# NOTE: variables of the client and the launcher that share the prefix but are no config field
NOT_FIELDS = frozenset({"PDCLUSTER_API_KEY", "PDCLUSTER_API_KEYS"})  # the client's key; the keys deploy/ names


def overrides(config_cls: type[BaseModel]) -> dict[str, Any]:
    """The config fields the environment sets, as a nested dict of raw values (validated with the YAML)."""
    if not any(k.upper().startswith(PREFIX) and k.upper() not in NOT_FIELDS for k in os.environ):
        return {}
    fields: Any = {name: (f.annotation, None) for name, f in config_cls.model_fields.items()}
    settings_cls = create_model("_EnvOverrides", __base__=BaseSettings, **fields)
    source = EnvSettingsSource(settings_cls, env_prefix=PREFIX, env_nested_delimiter=DELIMITER, case_sensitive=False)
    return dict(source())


def merge(base: Any, extra: Mapping[str, Any]) -> dict[str, Any]:
    """`base` (a YAML mapping or None) with `extra` laid over it, section by section."""
    out = dict(base) if isinstance(base, Mapping) else {}
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def variable_of(path: str) -> str:
    """The environment variable that sets a dotted config path (`router.port` → PDCLUSTER_ROUTER__PORT)."""
    return PREFIX + path.replace(".", DELIMITER).upper()
