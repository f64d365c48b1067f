"""The ZooKeeper tree text format: parse and format, no I/O.

Theory of operation
-------------------

A site's whole ZooKeeper configuration lives in one text file under
version control; ``zc-lb zk import`` makes ZooKeeper match it and
``zc-lb zk export`` writes it back.  The format::

    # comment (only whole lines; a '#' inside a value is part of it)
    /lb                            a node, by its name (one path segment)
      variance = 4                 a property: JSON when it parses,
      description = main site      ... else the string as written
      /workers                     a child node: indented deeper
        history = 9999
        /providers
      backend -> /lb/workers       a link named "backend" to /lb/workers

Rules:

- Indentation is spaces only (a tab is an error, since its width is a
  guess, and so is any other white space).  Everything under a node
  (properties, links, children) is indented deeper than the node, all at
  one consistent depth.  Nodes nest at most ``MAX_DEPTH`` deep.
- A name holds no character ZooKeeper refuses in a path (control
  characters, U+D800 to U+F8FF, U+FFF0 to U+FFFF); ``/zookeeper``,
  ZooKeeper's own node, is never imported.
- Properties and links before the first top-level node belong to the
  root of the import (the path given to ``import``), never after it: a
  property at column 0 after a node is almost always a missing indent.
- A name appears once per node: no duplicate children, properties or
  links, and a link may not share a child's name.
- A property value is parsed as JSON when it parses (``4``, ``1.0``,
  ``true``, ``"1.0"``, ``[1, 2]``), else kept as the string written,
  trimmed.  Formatting writes a string bare when that reads back the
  same, else as JSON, so ``parse(format(t)) == t``.

Links are stored in ZooKeeper the way zc.zk stored them, so tools that
know zc.zk read our trees: a link ``name -> /target`` on node N is the
property ``"name ->": "/target"`` in N's JSON data.  ``to_data`` and
``from_data`` convert between a node's properties/links and its data.
A relative target is resolved from the node holding the link.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

from zc_lb.errors import ConfigurationError

LINK_SUFFIX = " ->"
INDENT = "  "
MAX_DEPTH = 100  # nodes nested in a file: deeper is a mistake (and a deep recursion)


@dataclass
class Node:
    """One node of a tree: its properties, links and children by name.

    ``notes`` are comment lines written above the node's children when
    formatting (export uses them to mention ephemeral nodes); parsing
    drops comments, so notes take no part in equality.
    """

    properties: dict[str, Any] = field(default_factory=dict)
    links: dict[str, str] = field(default_factory=dict)
    children: dict[str, Node] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list, compare=False)


def parse_value(text: str) -> Any:
    """A property value: JSON when it parses (nested too deep to read, it
    does not), else the trimmed string."""
    text = text.strip()
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text


def format_value(value: Any) -> str:
    """The text ``parse_value`` reads back as ``value``, on one line."""
    if isinstance(value, str) and value == value.strip() and _one_line(value):
        if parse_value(value) == value:
            return value
    text = json.dumps(value, ensure_ascii=False)
    return text if _one_line(text) else json.dumps(value)  # (U+2028 escaped)


def _one_line(text: str) -> bool:
    """Whether ``text`` is one line, non-empty, by str.splitlines (U+2028,
    U+0085... end lines too)."""
    return text.splitlines() == [text]


def parse_assignment(text: str) -> tuple[str, Any]:
    """``key=value`` (as given to ``zc-lb zk set``) -> (key, value)."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigurationError(f"expected key=value, got {text!r}")
    return key, parse_value(value)


def to_data(node: Node) -> dict[str, Any]:
    """A node's properties and links as the JSON object stored in ZooKeeper."""
    data = dict(node.properties)
    for name, target in node.links.items():
        data[name + LINK_SUFFIX] = target
    return data


def from_data(data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Split stored node data into (properties, links)."""
    properties, links = {}, {}
    for key, value in data.items():
        if key.endswith(LINK_SUFFIX) and isinstance(value, str):
            links[key[: -len(LINK_SUFFIX)]] = value
        else:
            properties[key] = value
    return properties, links


# Parsing ------------------------------------------------------------------


class _Frame:
    """A node being filled while parsing, and where its contents sit."""

    def __init__(self, node: Node, indent: int, child_indent: int | None,
                 path: str = "/"):
        self.node = node
        self.indent = indent
        self.child_indent = child_indent
        self.path = path


def parse(text: str, check: Callable[[str, str, Any], None] | None = None) -> Node:
    """Parse tree text into its root ``Node``; raise ConfigurationError
    naming the line number and text of the first mistake.  ``check(path,
    key, value)``, when given, may refuse a property (by raising
    ConfigurationError) of any node but the ephemeral ``providers``."""
    root = Node()
    stack = [_Frame(root, -1, 0)]
    seen_top_node = False
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        try:
            indent = _indent_of(line)
            frame = _frame_for(stack, indent)
            if stripped.startswith("/"):
                if len(stack) > MAX_DEPTH:
                    raise ValueError(f"nodes nested more than {MAX_DEPTH} deep")
                name, child = _parse_node(stripped, frame.node)
                stack.append(_Frame(child, indent, None,
                                    frame.path.rstrip("/") + "/" + name))
                seen_top_node = seen_top_node or frame.node is root
            elif frame.node is root and seen_top_node:
                raise ValueError(
                    "property or link after a top-level node: indent it"
                    " under its node, or move it before the first node"
                )
            else:
                prop = _parse_member(stripped, frame.node)
                if prop is not None and check is not None \
                        and PROVIDERS not in frame.path.split("/"):
                    check(frame.path, *prop)
        except (ConfigurationError, ValueError) as e:
            raise ConfigurationError(
                f"line {number}: {e}: {line.strip()!r}") from None
    return root


def _frame_for(stack: list[_Frame], indent: int) -> _Frame:
    """The frame a line indented by ``indent`` belongs to, popping the
    frames it closes; ValueError if the indent is not its siblings'."""
    while stack[-1].indent >= indent:
        stack.pop()
    frame = stack[-1]
    if frame.child_indent is None:
        frame.child_indent = indent
    elif frame.child_indent != indent:
        raise ValueError("indentation does not match the lines above")
    return frame


def _indent_of(line: str) -> int:
    body = line.lstrip()
    for char in line[: len(line) - len(body)]:
        if char == "\t":
            raise ValueError("tab in indentation (use spaces)")
        if char != " ":
            raise ValueError(f"U+{ord(char):04X} in indentation (use spaces)")
    return len(line) - len(body)


def _parse_node(stripped: str, parent: Node) -> tuple[str, Node]:
    name = stripped[1:].strip()
    _check_name(name, "node")
    if name in parent.children or name in parent.links:
        raise ValueError(f"duplicate name {name!r}")
    child = parent.children[name] = Node()
    return name, child


def _parse_member(stripped: str, node: Node) -> Optional[tuple[str, Any]]:
    """Add a property or link line to ``node``; the property, if it was one."""
    arrow, equals = stripped.find("->"), stripped.find("=")
    if arrow >= 0 and (equals < 0 or arrow < equals):
        name, target = stripped[:arrow].strip(), stripped[arrow + 2 :].strip()
        _check_name(name, "link")
        if not target:
            raise ValueError("link without a target")
        if name in node.links or name in node.children:
            raise ValueError(f"duplicate name {name!r}")
        node.links[name] = target
        return None
    if equals >= 0:
        key = stripped[:equals].strip()
        if not key:
            raise ValueError("property without a name")
        if key in node.properties:
            raise ValueError(f"duplicate property {key!r}")
        value = node.properties[key] = parse_value(stripped[equals + 1 :])
        return key, value
    raise ValueError("expected '/node', 'key = value' or 'name -> /path'")


def _check_name(name: str, what: str) -> None:
    if not name or name in (".", "..") or "/" in name or "->" in name:
        raise ValueError(f"bad {what} name {name!r}")
    for char in name:
        if _refused_in_paths(char):
            raise ValueError(f"bad {what} name {name!r}: ZooKeeper refuses"
                             f" U+{ord(char):04X} in a path")


def _refused_in_paths(char: str) -> bool:
    """The characters ZooKeeper refuses in a path (its PathUtils)."""
    code = ord(char)
    return (code < 0x20 or 0x7F <= code <= 0x9F or 0xD800 <= code <= 0xF8FF
            or 0xFFF0 <= code <= 0xFFFF)


def _check_key(path: str, key: str) -> None:
    """Refuse (when formatting) a key that would not read back as itself."""
    if (
        not _bare(key)
        or key[0] in "/#"
        or "=" in key
        or "->" in key
    ):
        raise ConfigurationError(
            f"{path}: property name {key!r} cannot be written as text")


def _check_link(path: str, name: str, target: str) -> None:
    """Refuse (when formatting) a link that would not read back as itself:
    a name with '=' would be a property, one with '#' first a comment."""
    try:
        _check_name(name, "link")
    except ValueError as e:
        raise ConfigurationError(f"{path}: {e}: cannot be written as text") from None
    if not (_bare(name) and _bare(target)) or name[0] in "/#" or "=" in name:
        raise ConfigurationError(
            f"{path}: link {name!r} -> {target!r} cannot be written as text")


def _check_child(path: str, name: str, depth: int) -> None:
    """Refuse (when formatting) a node that would not read back as itself."""
    try:
        _check_name(name, "node")
    except ValueError as e:
        raise ConfigurationError(f"{path}: {e}: cannot be written as text") from None
    if not _bare(name):
        raise ConfigurationError(f"{path}: node name {name!r} cannot be written as text")
    if depth >= MAX_DEPTH:
        raise ConfigurationError(f"{path}: nested more than {MAX_DEPTH} deep")


def _bare(text: str) -> bool:
    """Whether ``text`` reads back as itself within a line (not trimmed)."""
    return _one_line(text) and text == text.strip()


# Formatting ---------------------------------------------------------------


def format(root: Node) -> str:
    """Tree text for ``root``: its own properties and links first, then
    its children as top-level nodes (children sorted by name).  What
    would not read back as it is (``parse(format(t)) == t``) is refused:
    ConfigurationError naming the node."""
    lines: list[str] = []
    _format_contents(root, "/", 0, lines)
    return "".join(line + "\n" for line in lines)


def _format_contents(node: Node, path: str, depth: int, lines: list[str]) -> None:
    pad = INDENT * depth
    for key, value in node.properties.items():
        _check_key(path, key)
        lines.append(f"{pad}{key} = {format_value(value)}")
    for name, target in node.links.items():
        _check_link(path, name, target)
        lines.append(f"{pad}{name} -> {target}")
    for note in node.notes:
        lines.extend(f"{pad}# {line}" for line in note.splitlines() or [""])
    for name in sorted(node.children):
        child = _join(path, name)
        _check_child(child, name, depth)
        lines.append(f"{pad}/{name}")
        _format_contents(node.children[name], child, depth + 1, lines)


# Import planning ----------------------------------------------------------
#
# Planning is pure: it asks a reader what is stored (zookeeper/client.py's reader asks
# ZooKeeper; tests use a dict) and returns the changes that make the store
# match a tree.  zookeeper/client.py commits them in one transaction.


@dataclass(frozen=True)
class Stored:
    """What planning needs to know of an existing node."""

    data: Optional[dict]  # None when the data is not a JSON object
    version: int
    ephemeral: bool


class Reader(Protocol):
    def node(self, path: str) -> Optional[Stored]:
        """The node at ``path``, or None if there is none."""

    def children(self, path: str) -> list[str]:
        """The names of the children of ``path`` ([] if there is none)."""


@dataclass(frozen=True)
class Change:
    """One step of an import: ``create``, ``set`` or ``delete`` a node (at
    ``version``, -1 for create), or ``skip`` one (``details`` say why;
    nothing is written)."""

    action: str
    path: str
    data: Optional[dict] = None
    version: int = -1
    details: tuple[str, ...] = ()

    def __str__(self) -> str:
        return "\n".join([f"{self.action} {self.path}",
                          *(f"  {d}" for d in self.details)])


def plan(reader: Reader, desired: Node, root: str = "/",
         delete: bool = False) -> list[Change]:
    """The changes that make the store under ``root`` match ``desired``:
    see zk.import_tree for the rules."""
    changes: list[Change] = []
    segments = [s for s in root.split("/") if s]
    if _under_providers(root):
        return [Change("skip", root, None, -1, (PROVIDERS_SKIPPED,))]
    missing = False
    for i in range(1, len(segments)):
        ancestor = "/" + "/".join(segments[:i])
        missing = missing or reader.node(ancestor) is None
        if missing:
            changes.append(Change("create", ancestor, {}))
    _plan_node(reader, "/" + "/".join(segments), desired, delete, missing,
               changes)
    return changes


def _join(path: str, name: str) -> str:
    return path.rstrip("/") + "/" + name


PROVIDERS = "providers"
PROVIDERS_SKIPPED = ("under a providers node: registrations are made by running"
                     " processes, never by an import")


def _under_providers(path: str) -> bool:
    """Whether ``path`` lies under a ``providers`` node (the node itself
    does not): where processes register, and imports never write."""
    return PROVIDERS in path.split("/")[:-1]


def _plan_node(reader: Reader, path: str, node: Node, delete: bool,
               missing: bool, changes: list[Change]) -> None:
    if _under_providers(path):
        changes.append(Change("skip", path, None, -1, (PROVIDERS_SKIPPED,)))
        return
    if path == "/zookeeper":
        raise ConfigurationError("/zookeeper is ZooKeeper's own node: an import"
                                 " neither writes nor exports it")
    desired = to_data(node)
    stored = None if missing else reader.node(path)
    if stored is None:
        changes.append(Change("create", path, desired, -1, tuple(
            _describe(k, v) for k, v in desired.items())))
        for name, child in node.children.items():
            _plan_node(reader, _join(path, name), child, delete, True, changes)
        return
    if stored.ephemeral:
        changes.append(Change("skip", path, None, -1, (
            "ephemeral: a live registration, left alone",)))
        return
    if stored.data is None:
        raise ConfigurationError(
            f"{path} holds data that is not a JSON object; not touching it")
    new, details = _merge(stored.data, desired, delete)
    if details:
        changes.append(Change("set", path, new, stored.version, tuple(details)))
    existing = set(reader.children(path))
    for name, child in node.children.items():
        _plan_node(reader, _join(path, name), child, delete,
                   name not in existing, changes)
    if delete:
        for name in sorted(existing - set(node.children)):
            if not (path == "/" and name == "zookeeper") \
                    and not _under_providers(_join(path, name)):
                _plan_delete(reader, _join(path, name), changes)


def _merge(current: dict, desired: dict, delete: bool
           ) -> tuple[dict, list[str]]:
    new, details = dict(current), []
    for key, value in desired.items():
        if key not in current:
            details.append(_describe(key, value))
        elif not _same(current[key], value):
            details.append(f"{_describe(key, value)}"
                           f" (was {format_value(current[key])})")
        new[key] = value
    if delete:
        for key in current:
            if key not in desired:
                del new[key]
                details.append(f"remove {_describe(key, current[key])}")
    return new, details


def _same(a: Any, b: Any) -> bool:
    """Equal as stored: 4 and 4.0, or 1 and true, differ in JSON."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def _describe(key: str, value: Any) -> str:
    if key.endswith(LINK_SUFFIX) and isinstance(value, str):
        return f"{key[:-len(LINK_SUFFIX)]} -> {value}"
    return f"{key} = {format_value(value)}"


def _plan_delete(reader: Reader, path: str, changes: list[Change]) -> None:
    stored = reader.node(path)
    if stored is None or stored.ephemeral:
        return  # gone, or a live registration: never ours to delete
    doomed: list[tuple[str, int]] = []
    if _collect(reader, path, stored, doomed):
        changes.extend(Change("delete", p, None, v) for p, v in doomed)
    else:
        changes.append(Change("skip", path, None, -1, (
            "not in the file, but holds ephemeral nodes (live registrations)",)))


def _collect(reader: Reader, path: str, stored: Stored,
             doomed: list[tuple[str, int]]) -> bool:
    """Append (path, version), children first; False if any is ephemeral."""
    if stored.ephemeral:
        return False
    for name in reader.children(path):
        child = reader.node(_join(path, name))
        if child and not _collect(reader, _join(path, name), child, doomed):
            return False
    doomed.append((path, stored.version))
    return True
