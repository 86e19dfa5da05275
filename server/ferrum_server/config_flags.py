"""Which fields of the configuration dataclasses are `ferrum-executor serve` flags.

Every field of EngineConfig, ServerConfig, LogConfig (config.py) and SecurityConfig
(security.py) carries, in `dataclasses.field(metadata=...)`, either `flag(help, ...)`: the CLI
turns it into `--<name>` and its environment twin FERRUM_<NAME>; or `NOT_A_FLAG`: set in code
only. The default lives in the dataclass alone, and the flag parses its value by the field's
type (a bool field takes true/false, yes/no, on/off, 1/0).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

_KEY = "ferrum_server.flag"


@dataclass(frozen=True, slots=True)
class FlagInfo:
    help: str
    # The flag's name (without the leading dashes); "" = the field's, underscores as dashes.
    name: str = ""
    choices: tuple[str, ...] | None = None


def flag(help: str, *, name: str = "", choices: tuple[str, ...] | None = None) -> Mapping[str, Any]:
    """Field metadata: the field is the `serve` flag --<name> (and FERRUM_<NAME>)."""
    return MappingProxyType({_KEY: FlagInfo(help, name, choices)})


# Field metadata: the field is set in code only, never from the command line.
NOT_A_FLAG: Mapping[str, Any] = MappingProxyType({_KEY: None})


def flag_info(field: dataclasses.Field[Any]) -> FlagInfo | None:
    """The field's flag, or None for NOT_A_FLAG; a field marked neither is a mistake."""
    if _KEY not in field.metadata:
        raise LookupError(f"config field {field.name!r} is marked neither flag(...) nor NOT_A_FLAG")
    info = field.metadata[_KEY]
    if info is not None and not isinstance(info, FlagInfo):
        raise TypeError(f"config field {field.name!r} has malformed flag metadata")
    return info
