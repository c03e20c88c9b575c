"""Typed reads of Hugging Face config.json fields, shared by models/config.py and models/config_hybrid.py."""

from __future__ import annotations

import math
from typing import Any


class ConfigError(ValueError):
    """A configuration that cannot work (config.json, runtime limits, flags); the message names the fix."""


def eos_ids(eos: Any) -> tuple[int, ...]:
    if eos is None:
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise ConfigError(f"eos_token_id must be a token id or a list of them (integers >= 0), got {eos!r}")
    return tuple(ids)


class Fields:
    """Typed reads of config.json fields; null counts as absent (HF configs write null for "default")."""

    def __init__(self, raw: dict[str, Any], prefix: str = "") -> None:
        self.raw, self.prefix = raw, prefix

    def _bad(self, key: str, what: str, value: Any) -> ConfigError:
        kind = "" if isinstance(value, int | float) and not isinstance(value, bool) else f" (a {type(value).__name__})"
        return ConfigError(f"{self.prefix}{key} must be {what}, got {value!r}{kind}; fix config.json")

    def integer(self, key: str, default: int | None = None, minimum: int = 1) -> int:
        value = self.raw.get(key)
        if value is None:
            if default is None:
                raise ConfigError(f"config.json is missing required field {self.prefix}{key}")
            return default
        ok = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        if isinstance(value, bool) or not ok or value < minimum:
            raise self._bad(key, f"an integer >= {minimum}", value)
        return int(value)

    def number(self, key: str, default: float, allow_zero: bool = False) -> float:
        value = self.raw.get(key)
        if value is None:
            return default
        bad_type = isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
        if bad_type or value < 0 or (value == 0 and not allow_zero):
            raise self._bad(key, "a finite number >= 0" if allow_zero else "a finite number > 0", value)
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.raw.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._bad(key, "true or false", value)
        return value
