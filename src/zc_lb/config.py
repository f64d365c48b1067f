"""``--config FILE``: a TOML file with an ``[lb]`` and/or a ``[worker]`` table.

Why TOML (tomllib, in the standard library since Python 3.11, which
zc-lb requires) rather than INI: values are typed (``variance = 2.0``,
``single_version = true``) and lists are lists (``worker = ["a:9001",
"b:9001"]``, where INI would need a convention for repeated keys); the
grammar is strict (a duplicate key or an unclosed string is an error, with
its line, not a silent last-one-wins); and there is no ``%`` interpolation
to trip over in ``access_log_format``.

The keys are the command's long options, dashes written as underscores
(``--backlog-history`` is ``backlog_history``), taken from the command's
argparse parser, whose options come from the settings table (settings.py)
and the structural options beside it: so every option has a key and a
key is checked, converted and limited as its option is.  A bad key or
value is a ConfigurationError ``FILE:LINE: reason`` (exit status 2).

The file's values become the parser's defaults and the command line is
parsed again: the command line overrides the file.  ``--worker`` given on
the command line replaces the file's list rather than adding to it.
"""

from __future__ import annotations

import argparse
import re
from typing import Any, Dict, Iterable, List, Mapping, Tuple

from zc_lb import settings as settings_module
from zc_lb.errors import ConfigurationError

NOT_IN_FILE = frozenset({"help", "config", "listen_fd", "process_index"})
_KEY_LINE = re.compile(r"""^\s*(?:"([^"]*)"|'([^']*)'|([A-Za-z0-9_.-]+))\s*=""")
_TABLE_LINE = re.compile(r"^\s*\[\s*([^\]]*?)\s*\]")
_TOML_ERROR = re.compile(r"^(.*) \(at line (\d+), column (\d+)\)$")


class Parser(argparse.ArgumentParser):
    """zc-lb's argument parser: an ``ArgumentParser`` that keeps in public
    what the rest of zc-lb reads of it, so that nothing reaches into
    argparse's private parts: ``options``, the actions its own
    ``add_argument`` (and its exclusive groups') made, in order, and
    ``kinds``, each of them -> its argparse action name ("store",
    "store_true", "store_const", "append"...).  ``group`` lists options
    in --help under titles of their own.  (Subparsers are of this class
    too: argparse makes them of their parent's.)"""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # (before argparse's own __init__, which adds --help through ours)
        self.options: List[argparse.Action] = []
        self.kinds: Dict[argparse.Action, str] = {}
        self.sections: Dict[str, Any] = {}  # dest -> the argument group it is listed in
        super().__init__(*args, **kwargs)

    def group(self, groups: Mapping[str, Iterable[str]]) -> None:
        """List the options of ``groups`` (title -> their dests) under those
        titles in --help, in that order of titles; before adding them.
        Parsing is not changed, only where each option is listed."""
        for title, dests in groups.items():
            section = self.add_argument_group(title)
            for dest in dests:
                self.sections[dest] = section

    def add_argument(self, *names: Any, **kwargs: Any) -> argparse.Action:
        section = self.sections.get(kwargs.get("dest") or option_dest(names))
        add = super().add_argument if section is None else section.add_argument
        return self._noted(add(*names, **kwargs), kwargs)

    def add_mutually_exclusive_group(self, **kwargs: Any) -> Any:
        group = super().add_mutually_exclusive_group(**kwargs)
        add = group.add_argument

        def add_argument(*names: Any, **kwargs: Any) -> argparse.Action:
            return self._noted(add(*names, **kwargs), kwargs)

        group.add_argument = add_argument
        return group

    def _noted(self, action: argparse.Action, kwargs: Mapping[str, Any]) -> argparse.Action:
        kind = kwargs.get("action", "store")
        if kind == "help":
            return action
        self.options.append(action)
        self.kinds[action] = kind if isinstance(kind, str) else "store"
        return action


def option_dest(names: Iterable[str]) -> str:
    """The dest argparse gives an argument of these names: the first long
    option's, else the first short option's, dashes made underscores, or
    a positional's name."""
    names = list(names)
    for prefix in ("--", "-"):
        for name in names:
            if name.startswith(prefix):
                return name[len(prefix):].replace("-", "_")
    return names[0]


def options(parser: Parser) -> Dict[str, argparse.Action]:
    """The file keys of a command's parser: key -> argparse action."""
    keys = {}
    for action in parser.options:
        if action.help == argparse.SUPPRESS:
            continue
        longs = [o for o in action.option_strings if o.startswith("--")]
        if longs:
            key = longs[0][2:].replace("-", "_")
        elif not action.option_strings:
            key = action.dest  # a positional: the worker's app
        else:
            continue
        if key not in NOT_IN_FILE:
            keys[key] = action
    return keys


def _lines(text: str) -> Dict[Tuple[str, str], int]:
    """(table, key) -> line number, for the messages (tomllib gives none)."""
    where: Dict[Tuple[str, str], int] = {}
    table = ""
    for number, line in enumerate(text.splitlines(), 1):
        match = _TABLE_LINE.match(line)
        if match and "=" not in line.split("]")[0]:
            table = match.group(1).strip('"\'')
            where.setdefault((table, ""), number)
            continue
        match = _KEY_LINE.match(line)
        if match:
            key = next(g for g in match.groups() if g is not None).split(".")[0]
            where.setdefault((table, key), number)
    return where


def read(path: str) -> Tuple[Dict[str, Any], Dict[Tuple[str, str], int]]:
    """The parsed file and its lines; ConfigurationError if unreadable or
    not TOML."""
    import tomllib

    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise ConfigurationError("cannot read config file %s: %s" % (path, exc.strerror or exc))
    try:
        text = raw.decode("utf-8")
        document = tomllib.loads(text)
    except UnicodeDecodeError as exc:
        raise ConfigurationError("%s: not UTF-8 text: %s" % (path, exc))
    except tomllib.TOMLDecodeError as exc:
        match = _TOML_ERROR.match(str(exc))
        if match:
            raise ConfigurationError("%s:%s: %s (column %s)" % (
                path, match.group(2), match.group(1), match.group(3)))
        raise ConfigurationError("%s: %s" % (path, exc))
    return document, _lines(text)


def _convert(key: str, action: argparse.Action, kind: str, value: Any,
             table: Mapping[str, settings_module.Setting]) -> Tuple[str, Any]:
    """(dest, value) for the parser's defaults, ``kind`` being the
    action's name ("store_true"...); ValueError saying why not."""
    if isinstance(value, (dict, list)) and kind != "append":
        raise ValueError("%s takes one value, not a %s"
                         % (key, "table" if isinstance(value, dict) else "list"))
    if kind == "store_true":
        if not isinstance(value, bool):
            raise ValueError("%s must be true or false, got %r" % (key, value))
        return action.dest, value
    if kind == "store_const":
        if value is not True:
            raise ValueError("%s can only be true (leave it out otherwise), got %r"
                             % (key, value))
        return action.dest, action.const
    if kind == "append":
        items = value if isinstance(value, list) else [value]
        if not all(isinstance(item, str) for item in items):
            raise ValueError("%s must be a string or a list of strings, got %r" % (key, value))
        return action.dest, list(items)
    converted = _convert_one(key, action, value, table)
    if action.choices is not None and converted not in action.choices:
        raise ValueError("%s must be one of %s, got %r"
                         % (key, ", ".join(map(str, action.choices)), value))
    return action.dest, converted


def _convert_one(key: str, action: argparse.Action, value: Any,
                 table: Mapping[str, settings_module.Setting]) -> Any:
    """A single value, converted by its setting if it has one, else by its
    option's type, else taken as it is if a string; ValueError saying why
    not."""
    setting = table.get(action.dest)
    if setting is not None and (setting.option[2:].replace("-", "_") == key):
        try:
            return setting.convert(value)
        except ConfigurationError as exc:
            raise ValueError(str(exc))
    if action.type is not None:
        if isinstance(value, (bool, float)):
            raise ValueError("bad value for %s: %r" % (key, value))
        try:
            return action.type(str(value))
        except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
            raise ValueError("bad value for %s: %r (%s)" % (key, value, exc))
    if not isinstance(value, str):
        raise ValueError("%s must be a string, got %r" % (key, value))
    return value


def load(path: str, section: str, parser: Parser,
         table: Mapping[str, settings_module.Setting]) -> Dict[str, Any]:
    """The ``[section]`` of ``path`` as parser defaults (dest -> value);
    ConfigurationError ``FILE:LINE: reason`` for the first bad key or value."""
    document, lines = read(path)
    _check_tables(path, document, lines)
    if section not in document:
        raise ConfigurationError("%s has no [%s] table" % (path, section))
    known = options(parser)
    values: Dict[str, Any] = {}
    given: Dict[str, str] = {}  # dest -> key, for exclusive options
    for key, value in document[section].items():
        action = known.get(key)
        if action is None:
            raise _unknown_key(_where(path, lines, section, key), key, section, known)
        try:
            dest, converted = _convert(key, action, parser.kinds[action], value, table)
        except ValueError as exc:
            raise ConfigurationError("%s: %s" % (_where(path, lines, section, key), exc))
        if dest in given:
            raise ConfigurationError("%s: %s and %s exclude each other" % (
                _where(path, lines, section, key), given[dest], key))
        given[dest] = key
        values[dest] = converted
    return values


def _where(path: str, lines: Dict[Tuple[str, str], int], table_name: str,
           key: str = "") -> str:
    """``FILE:LINE`` of a table or key for a message, ``FILE`` if its line
    is unknown."""
    line = lines.get((table_name, key))
    return "%s:%d" % (path, line) if line else path


def _check_tables(path: str, document: Mapping[str, Any],
                  lines: Dict[Tuple[str, str], int]) -> None:
    """ConfigurationError for a top-level key, or a table other than
    ``[lb]`` and ``[worker]``."""
    for name, value in document.items():
        if name in ("lb", "worker"):
            continue
        if isinstance(value, dict):
            where, what = _where(path, lines, name), "table"
        else:
            where, what = _where(path, lines, "", name), "key"
        raise ConfigurationError("%s: unknown %s %r: put the settings in an [lb] or "
                                 "[worker] table" % (where, what, name))


def _unknown_key(where: str, key: str, section: str,
                 known: Mapping[str, argparse.Action]) -> ConfigurationError:
    """The error for a key that is none of the command's options, with
    the closest one as a hint."""
    import difflib

    close = difflib.get_close_matches(key.replace("-", "_"), known, 1)
    hint = " (did you mean %s?)" % close[0] if close else ""
    return ConfigurationError("%s: unknown key %r in [%s]%s; known: %s" % (
        where, key, section, hint, ", ".join(sorted(known))))


def apply(parser: argparse.ArgumentParser, argv: List[str], command_parser: Parser,
          path: str, section: str,
          table: Mapping[str, settings_module.Setting]) -> argparse.Namespace:
    """Parse ``argv`` again with ``path``'s values as the command's
    defaults: the command line overrides the file."""
    values = load(path, section, command_parser, table)
    appends = {action.dest for action, kind in command_parser.kinds.items() if kind == "append"}
    appended = {dest: values.pop(dest) for dest in list(values) if dest in appends}
    saved = {action.dest: action.default for action in command_parser.options}
    command_parser.set_defaults(**values)
    try:
        args, rest = parser.parse_known_args(argv)
    finally:
        command_parser.set_defaults(**saved)
    for dest, value in appended.items():
        if getattr(args, dest, None) is None:  # the command line's list replaces the file's
            setattr(args, dest, value)
    return args
