"""The machinery of a table of options: :class:`Option`, one option as a field of a settings
dataclass declares it (:func:`option`); :class:`Table`, the options of such a dataclass, derived
from its fields, and what the faces make of them: flags on a command (:meth:`Table.add_option`),
values read from flags, environment variables and ini keys by precedence
(:meth:`Table.from_sources`), each face's flag for an option (:meth:`Table.flag`,
:meth:`Table.names`); :class:`Parser`, the commands' parser. ``harness/settings.py`` holds the
table of a run's settings on it.

Precedence: command line > environment variable (where one is named) > ini key (pytest only) >
default.

This module imports only the standard library and the shared value checks: the pytest plugin
reads it at start-up, in every pytest run of every project that has the package installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from .. import checks
from ..protocol import Names


class SettingError(ValueError):
    """A value that does not parse, or options that do not go together; the message names each
    option involved, where its value came from, and what was expected."""


def _shown(check: checks.Check[Any], default: Any) -> str:
    """A default as a help text gives it ("" for none)."""
    if default is None:
        return ""
    text = check.show(default)
    return repr(text) if " " in text else text


def metavar_of(check: checks.Check[Any]) -> str:
    """How the help writes a value of ``check``'s kind: its choices, N for a count, KEY for a
    secret, PATH, X for another number, TEXT; an option names its own where these say too little
    (SECONDS, URL, GB)."""
    if check.choices:
        return "{" + ",".join(check.choices) + "}"
    if check.secret:
        return "KEY"
    if check.types == (int,):
        return "N"
    if Path in check.types:
        return "PATH"
    if float in check.types:
        return "X"
    return "TEXT"


def plain(text: str) -> str:
    """A docstring's text as a terminal shows it: ``literal`` and `name` without their backticks,
    :role:`target` as the target."""
    text = re.sub(r":\w+:`~?([^`]*)`", r"\1", text)
    return re.sub(r"``([^`]*)``|`([^`]*)`", lambda m: m[1] if m[1] is not None else m[2], text)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description as written (its examples keep their lines), every text in :func:`plain` words."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return super()._fill_text(plain(text), width, indent)

    def _expand_help(self, action: argparse.Action) -> str:
        return plain(super()._expand_help(action))


class Parser(argparse.ArgumentParser):
    """A command's parser that answers a bad argument in one line and a pointer to ``--help``
    (argparse's own first prints the whole usage); exit status 2, as argparse's. Its sub-commands'
    parsers are of this class too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n{self.prog} --help lists the options\n")


_BY_NAME = "<by name>"  # a flag spelled from the option's name: --max-tokens, --ppsmoke-max-tokens


@dataclass(frozen=True)
class Option:
    """One option, as a :class:`Settings` field declares it (:func:`option`). ``about`` says what
    it is; :attr:`help` adds its default from the value. ``cli`` is the ``pp-smoke-run`` flag (None:
    not there); ``pytest`` the plugin's flag (None: not there), whose ini key is the flag with
    ``--`` dropped and ``-`` as ``_`` unless ``ini`` is False (a secret would get committed).
    ``default`` None with a ``default_text``: the mode decides it (:meth:`Settings.resolve`).
    ``group``: the task the help lists it under (:data:`GROUPS`); ``metavar``: its value as the
    help writes it (``{bf16,f16,f32}``, ``N``, ``SECONDS``)."""

    name: str
    about: str
    check: checks.Check[Any]
    default: Any = None
    cli: str | None = _BY_NAME
    pytest: str | None = _BY_NAME
    env: str | None = None
    ini: bool = True
    group: str = "run"
    default_text: str = ""
    metavar: str = ""

    @property
    def help(self) -> str:
        shown = self.default_text or _shown(self.check, self.default)
        return f"{self.about} (default {shown})" if shown else self.about

    @property
    def secret(self) -> bool:
        return self.check.secret

    @property
    def choices(self) -> tuple[str, ...] | None:
        return self.check.choices

    def parse(self, text: str) -> Any:
        """The value ``text`` gives this option; :class:`checks.Invalid` when it is not one."""
        return self.check.parse(text)

    @property
    def ini_name(self) -> str | None:
        if not self.pytest or not self.ini:
            return None
        name = self.pytest.lstrip("-").replace("-", "_")
        return name if name.startswith("ppsmoke_") else "ppsmoke_" + name


def option(
    default: Any,
    about: str,
    check: checks.Check[Any],
    *,
    cli: str | None = _BY_NAME,
    pytest: str | None = _BY_NAME,
    env: str | None = None,
    ini: bool = True,
    group: str = "run",
    default_text: str = "",
    metavar: str = "",
    repr: bool = True,
) -> Any:
    """A :class:`Settings` field that is an option: its default (``dataclasses.MISSING``: the mode
    decides it, ``default_text`` says how) and the rest of its :class:`Option`. ``group``: a key
    of :data:`GROUPS`; ``metavar``: how the help writes its value (default: its check's kind's,
    :func:`metavar_of`)."""
    value = None if default is MISSING else default
    spec = Option("", about, check, value, cli, pytest, env, ini, group, default_text, metavar or metavar_of(check))
    if default is MISSING:
        return field(repr=repr, metadata={"option": spec})
    return field(default=default, repr=repr, metadata={"option": spec})


class Table:
    """The options of a settings dataclass, in the order of its fields: each field declared with
    :func:`option`; ``groups``, the tasks the help groups them by (an option's ``group`` must be
    a key)."""

    def __init__(self, settings: type[Any], groups: Mapping[str, str]) -> None:
        self.groups = dict(groups)
        self.options: tuple[Option, ...] = tuple(self._declared(f) for f in dataclasses.fields(settings))
        self.by_field = {o.name: o for o in self.options}

    def __getitem__(self, name: str) -> Option:
        return self.by_field[name]

    def _declared(self, f: dataclasses.Field[Any]) -> Option:
        spec: Option = f.metadata["option"]
        if spec.group not in self.groups:
            raise ValueError(f"option {f.name}: group {spec.group!r} is not one of {', '.join(self.groups)}")
        flag = f.name.replace("_", "-")
        return dataclasses.replace(
            spec,
            name=f.name,
            cli="--" + flag if spec.cli == _BY_NAME else spec.cli,
            pytest="--ppsmoke-" + flag if spec.pytest == _BY_NAME else spec.pytest,
        )

    def add_option(
        self,
        parser: argparse.ArgumentParser | argparse._ArgumentGroup,
        name: str,
        flag: str | None = None,
        *,
        default: Any = MISSING,
        many: bool = False,
        required: bool = False,
    ) -> None:
        """Option ``name`` of the table as a flag of another command (``pp-layout``): its check parses
        the text (an error names the flag and what was expected), its help is the table's with the
        default this flag has. ``flag``: the command's spelling (default: ``pp-smoke-run``'s);
        ``default``: the command's own (default: the table's); ``many``: a comma-separated list of
        the option's values, a tuple."""
        opt = self.by_field[name]
        value = opt.default if default is MISSING else default

        def parse(text: str) -> Any:
            try:
                return tuple(opt.parse(t) for t in checks.items(text)) if many else opt.parse(text)
            except checks.Invalid as e:
                raise argparse.ArgumentTypeError(f"{text!r} {e}" if many else str(e)) from None

        if required:
            shown = ""
        elif many:
            shown = ",".join(_shown(opt.check, v) for v in value)
        else:
            shown = _shown(opt.check, value)
        about = f"{opt.about}, comma-separated" if many else opt.about
        help = (f"{about} (default {shown})" if shown else about).replace("%", "%%")
        flag = flag or opt.cli or "--" + name.replace("_", "-")
        parser.add_argument(
            flag,
            dest=name,
            type=parse,
            default=None if required else value,
            required=required,
            metavar=f"{opt.metavar},..." if many else opt.metavar,
            help=help,
        )

    def flag(self, name: str, face: str) -> str:
        """The flag of option ``name`` on ``face`` (pytest or cli), or its name where it has none there."""
        opt = self.by_field.get(name)
        if opt is None:
            return name
        return (opt.pytest if face == "pytest" else opt.cli) or opt.name

    def names(self, face: str) -> Names:
        """How ``face`` (pytest or cli) names each setting in a lower layer's message: its flags."""
        return Names({opt.name: self.flag(opt.name, face) for opt in self.options})

    def named(self, name: str, sources: Mapping[str, str], face: str) -> str:
        """An option as an error names it: its flag on this face, and where its value came from."""
        opt = self.by_field[name]
        flag = (opt.pytest if face == "pytest" else opt.cli) or opt.name
        source = sources.get(name)
        if source is None:
            return f"{flag} (the default)"
        return flag if source == flag else f"{flag} (from {source})"

    def from_sources(
        self,
        flags: Mapping[str, Any],
        ini: Callable[[str], Any] | None = None,
        env: Mapping[str, str] | None = None,
        face: str = "pytest",
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """Each option's parsed value (absent when nowhere given) and where it came from, by
        precedence: ``flags`` (already parsed or raw text, keyed by option name) > ``env`` > ``ini``.
        ``face`` (pytest or cli) picks the flag names that errors use. Raises
        :class:`SettingError` naming the option, its source and what was expected."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for opt in self.options:
            raw: Any = None
            source = ""
            flag = (opt.pytest if face == "pytest" else opt.cli) or opt.name
            if flags.get(opt.name) is not None:
                raw, source = flags[opt.name], flag
            elif opt.env and env.get(opt.env):
                raw, source = env[opt.env], f"environment variable {opt.env}"
            elif ini is not None and opt.ini_name:
                found = ini(opt.ini_name)
                if found not in (None, "", []):
                    raw, source = found, f"ini {opt.ini_name}"
            if raw is None:
                continue
            if isinstance(raw, str):
                try:
                    raw = opt.parse(raw)
                except checks.Invalid as e:
                    where = flag if source == flag else f"{flag} (from {source})"
                    raise SettingError(f"{where} {e}") from None
            values[opt.name], sources[opt.name] = raw, source
        return values, sources
