"""Every flag from an environment variable as well: `XDS_SERVER_<FLAG>`.

A Deployment sets variables from ConfigMaps and Secrets, and changing one flag of an
image's command otherwise means repeating the whole command. The rules:

- `--xds-port` is `XDS_SERVER_XDS_PORT`, `--log-level` `XDS_SERVER_LOG_LEVEL`. The flags of
  `bootstrap`, which describe an Envoy rather than this server (its `--xds-port` is where
  the Envoy connects, its `--admin-port` the Envoy's own), are `XDS_SERVER_BOOTSTRAP_<FLAG>`,
  so a server's variables never change a bootstrap made beside it.
- A flag on the command line wins over its variable. Of flags that exclude each other
  (`--config` and `--configmap`, `--plaintext` and the `--tls-*` files), one given on the
  command line also wins over the others' variables; two such variables are an error.
- A switch (`--kubernetes`) takes true/false, 1/0, yes/no or on/off; a repeatable flag
  (`--peer`) a comma-separated list. An empty variable counts as unset.
- A value that does not convert, or is not one of the choices, is a usage error (exit 2)
  naming the variable.

`EnvironmentParser.take_environment`, once every argument is added, writes each flag's
default and variable into its help, and swaps the defaults for `_Unset.TOKEN` so that
parsing can tell a flag given on the command line from one left at its default.
"""

from __future__ import annotations

import argparse
import enum
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

__all__ = ["EnvironmentParser", "PREFIX", "origin_of"]

PREFIX = "XDS_SERVER_"

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
# Where the parsed namespace records which values came from which variable.
_ORIGINS = "from_environment"


class _Unset(enum.Enum):
    """The default of a flag while parsing: not given on the command line."""

    TOKEN = enum.auto()


@dataclass(frozen=True)
class _Flag:
    action: argparse.Action
    variable: str
    # The default the flag had before `take_environment` swapped it for `_Unset.TOKEN`.
    default: Any


class EnvironmentParser(argparse.ArgumentParser):
    """An ArgumentParser whose flags also come from environment variables (module
    docstring). The root parser resolves them after parsing, for itself and the command
    chosen; its subcommands' parsers (of this class too) only hold their flags.

    `environ` is where variables are read (None: `os.environ` at parse time).
    """

    def __init__(self, *args: Any, environ: Mapping[str, str] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._environ = environ
        self._root = False
        self._flags: list[_Flag] = []
        self._exclusive: list[tuple[tuple[str, ...], ...]] = []
        self._required: list[tuple[str, ...]] = []

    def flags_exclude(self, *sides: Sequence[str]) -> None:
        """Declare flags (by dest) that exclude each other beyond argparse's groups: one
        given on the command line sets the others' variables aside."""
        self._exclusive.append(tuple(tuple(side) for side in sides))

    def take_environment(self, *, command_prefixes: Mapping[str, str] | None = None) -> None:
        """Call on the root parser once every argument is added. A subcommand's variables
        are `PREFIX` + `command_prefixes[name]` (default "") + the flag."""
        self._root = True
        self._take(PREFIX)
        for name, parser in self._commands().items():
            parser._take(PREFIX + (command_prefixes or {}).get(name, ""))

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, rest = super().parse_known_args(args, namespace)
        if self._root:
            environ = os.environ if self._environ is None else self._environ
            origins: dict[str, str] = {}
            for parser in (self, *self._chosen(parsed)):
                parser._resolve(parsed, environ, origins)
            setattr(parsed, _ORIGINS, origins)
        return parsed, rest

    def _commands(self) -> dict[str, EnvironmentParser]:
        return {
            name: parser
            for action in self._actions
            if isinstance(action, argparse._SubParsersAction)
            for name, parser in action.choices.items()
            if isinstance(parser, EnvironmentParser)
        }

    def _chosen(self, parsed: argparse.Namespace) -> list[EnvironmentParser]:
        commands = self._commands()
        return [
            commands[getattr(parsed, action.dest)]
            for action in self._actions
            if isinstance(action, argparse._SubParsersAction)
            and getattr(parsed, action.dest, None) in commands
        ]

    def _take(self, prefix: str) -> None:
        for action in self._actions:
            if not action.option_strings or action.default is argparse.SUPPRESS:
                continue  # positionals, --help, --version
            flag = _Flag(action, _variable(prefix, action), action.default)
            self._flags.append(flag)
            action.help = _help(flag)
            if action.default is not None:
                action.default = _Unset.TOKEN  # None already says "not given"
        for group in self._mutually_exclusive_groups:
            sides = tuple((action.dest,) for action in group._group_actions)
            self._exclusive.append(sides)
            if group.required:
                # Checked after the variables are read: one of them may give it.
                group.required = False
                self._required.append(tuple(dest for (dest,) in sides))

    def _resolve(
        self, parsed: argparse.Namespace, environ: Mapping[str, str], origins: dict[str, str]
    ) -> None:
        given = set()
        for flag in self._flags:
            dest, value = flag.action.dest, getattr(parsed, flag.action.dest, None)
            if value is not _Unset.TOKEN and value is not None:
                given.add(dest)
                continue
            raw = environ.get(flag.variable, "").strip()
            if raw:
                setattr(parsed, dest, self._convert(flag, raw))
                origins[dest] = flag.variable
            else:
                setattr(parsed, dest, _default_value(flag))
        for sides in self._exclusive:
            self._settle(sides, given, parsed, origins)
        for dests in self._required:
            if not any(d in given or d in origins for d in dests):
                self._fail(f"one of {self._named(dests)} is required")

    def _settle(
        self,
        sides: tuple[tuple[str, ...], ...],
        given: set[str],
        parsed: argparse.Namespace,
        origins: dict[str, str],
    ) -> None:
        """Flags that exclude each other: the command line's set the variables aside."""
        if any(d in given for side in sides for d in side):
            for side in sides:
                if any(d in given for d in side):
                    continue
                for dest in side:
                    if origins.pop(dest, None) is not None:
                        setattr(parsed, dest, _default_value(self._flag(dest)))
            return
        from_environment = [side for side in sides if any(d in origins for d in side)]
        if len(from_environment) > 1:
            variables = [origins[d] for side in from_environment for d in side if d in origins]
            self._fail(f"{' and '.join(variables)} exclude each other; set only one")

    def _convert(self, flag: _Flag, raw: str) -> Any:
        action = flag.action
        if action.nargs == 0:  # a switch
            word = raw.lower()
            if word in _TRUE:
                return action.const
            if word in _FALSE:
                return flag.default
            self._fail(f"{flag.variable}={raw!r}: give true or false (1/0, yes/no, on/off)")
        if isinstance(action, argparse._AppendAction):
            return [self._one(flag, item.strip()) for item in raw.split(",") if item.strip()]
        return self._one(flag, raw)

    def _one(self, flag: _Flag, raw: str) -> Any:
        convert = flag.action.type
        try:
            value = convert(raw) if callable(convert) else raw
        except (TypeError, ValueError, argparse.ArgumentTypeError):
            name = getattr(convert, "__name__", "value")
            self._fail(f"{flag.variable}={raw!r}: not a valid {name}")
        choices = flag.action.choices
        if choices is not None and value not in choices:
            self._fail(
                f"{flag.variable}={raw!r}: not one of {', '.join(map(str, choices))}"
            )
        return value

    def _flag(self, dest: str) -> _Flag:
        (flag,) = (f for f in self._flags if f.action.dest == dest)
        return flag

    def _named(self, dests: Iterable[str]) -> str:
        flags = [self._flag(d) for d in dests]
        return " or ".join(f"{f.action.option_strings[-1]} ({f.variable})" for f in flags)

    def _fail(self, message: str) -> NoReturn:
        self.error(message)


def origin_of(parsed: argparse.Namespace, dest: str, option: str) -> str:
    """How to name a flag's value to the user: the variable it came from, else `option`."""
    origins: Mapping[str, str] = getattr(parsed, _ORIGINS, {})
    return origins.get(dest, option)


def _variable(prefix: str, action: argparse.Action) -> str:
    longest = max(action.option_strings, key=len)
    return prefix + longest.lstrip("-").upper().replace("-", "_")


def _default_value(flag: _Flag) -> Any:
    """The default as argparse gives it: a string default goes through the flag's type."""
    convert = flag.action.type
    if isinstance(flag.default, str) and callable(convert):
        return convert(flag.default)
    return flag.default


def _help(flag: _Flag) -> str:
    """The flag's help with its default (unless the text gives it, or there is none to
    show) and its variable; `%` escaped, as argparse formats help with it."""
    text = (flag.action.help or "").strip()
    shown = []
    if flag.default not in (None, False) and "default" not in text:
        shown.append(f"default: {flag.default}".replace("%", "%%"))
    shown.append(f"env {flag.variable}")
    return f"{text} ({'; '.join(shown)})".strip()
