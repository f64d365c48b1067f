"""zc_lb.zookeeper.tree: the ZooKeeper tree file format (parse, format) and the
pure plan of an import (applied to a real ZooKeeper in test_zk.py)."""

import pytest

from trees import SAMPLE, TREE
from zc_lb.zookeeper import tree
from zc_lb.errors import ConfigurationError


def test_tree_parse():
    root = tree.parse(TREE)
    lb = root.children["lb"]
    assert lb.properties == {"variance": 4, "backlog_history": 9,
                             "name": "main site", "quoted": "1.0"}
    assert lb.links == {"backend": "/lb/workers"}
    assert lb.children["workers"].properties["history"] == 9999
    assert lb.children["workers"].children["providers"] == tree.Node()


@pytest.mark.parametrize("text", [TREE, open(SAMPLE).read()])
def test_tree_round_trip(text):
    t = tree.parse(text)
    assert tree.parse(tree.format(t)) == t


@pytest.mark.parametrize("value", [
    4, 4.0, -1.5, True, None, "", "x", "1.0", "true", "null", " padded ",
    "two\nlines", "a # b", "a -> b", "é", [1, "a"], {"k": [None]}, '"q',
    "a\u2028b", ["\x85"], "#x",
])
def test_value_round_trip(value):
    root = tree.Node(properties={"k": value})
    assert tree.parse(tree.format(root)).properties == {"k": value}
    assert type(tree.parse_value(tree.format_value(value))) is type(value)


def test_a_value_nested_too_deep_for_json_is_a_string():
    deep = "[" * 100_000 + "]" * 100_000
    assert tree.parse_value(deep) == deep
    assert tree.parse(f"/a\n  k = {deep}\n").children["a"].properties == {"k": deep}


@pytest.mark.parametrize("node, named", [
    (tree.Node(links={"a=b": "/x"}), "/lb"),  # read back as a property
    (tree.Node(links={"#old": "/x"}), "/lb"),  # ... as a comment
    (tree.Node(links={" sp": "/x"}), "/lb"),  # ... trimmed
    (tree.Node(links={"k2": " /x"}), "/lb"),
    (tree.Node(links={"a\u2028b": "/x"}), "/lb"),  # ... as two lines
    (tree.Node(properties={"a\u2028b": 1}), "/lb"),
    (tree.Node(children={" w": tree.Node()}), "/lb/ w"),
    (tree.Node(children={"w\u2029": tree.Node()}), "/lb/w\u2029"),
])
def test_format_refuses_what_would_not_read_back(node, named):
    # Export then import silently turned such links into properties or
    # comments, and trimmed names.
    with pytest.raises(ConfigurationError) as info:
        tree.format(tree.Node(children={"lb": node}))
    assert str(info.value).startswith(named + ": ")


def test_format_refuses_nesting_parse_would():
    node = deepest = tree.Node()
    for _ in range(100):
        deepest.children["d"] = deepest = tree.Node()
    assert tree.parse(tree.format(node)) == node
    deepest.children["d"] = tree.Node()
    with pytest.raises(ConfigurationError, match="nested more than 100 deep"):
        tree.format(node)


def test_notes_stay_comments():
    text = tree.format(tree.Node(notes=["/h:1 (ephemeral) not\n/json"]))
    assert text == "# /h:1 (ephemeral) not\n# /json\n"
    assert tree.parse(text) == tree.Node()


def test_parse_assignment():
    assert tree.parse_assignment("a=4") == ("a", 4)
    assert tree.parse_assignment("a = x=y") == ("a", "x=y")
    assert tree.parse_assignment('v="2"') == ("v", "2")
    with pytest.raises(ConfigurationError):
        tree.parse_assignment("novalue")


@pytest.mark.parametrize("text, line", [
    ("/a\n  x = 1\n    y = 2\n", 3),
    ("/a\nx = 1\n", 2),
    ("/a\n\t/b\n", 2),
    ("# c\n\njunk\n", 3),
    ("/a\n  /b\n  /b\n", 3),
    ("/a\n  k = 1\n  k = 2\n", 3),
    ("/a/b\n", 1),
    ("/a\n  l ->\n", 2),
    ("/a\n  /b\n  b -> /c\n", 3),
    ("/a\n  /b\x01c\n", 2),  # names ZooKeeper refuses: a BadArgumentsError traceback
    ("/a\n  /\ue000\n", 2),
    ("/a\n  /b\ufff0\n", 2),
    ("/a\n\u00a0\u00a0/b\n", 2),  # NBSP indentation re-parented /b silently
    ("/a\n \u3000/b\n", 2),
    ("".join("  " * i + "/d\n" for i in range(101)), 101),  # (MAX_DEPTH + 1)
])
def test_parse_errors_name_the_line(text, line):
    with pytest.raises(ConfigurationError) as info:
        tree.parse(text)
    bad = text.splitlines()[line - 1].strip()
    assert str(info.value).startswith(f"line {line}: ")
    assert repr(bad) in str(info.value)


def test_a_tree_nested_very_deep_is_refused_without_recursing():
    # 1,200 levels raised RecursionError in zc-lb zk import.
    with pytest.raises(ConfigurationError, match="line 101: nodes nested more than 100"):
        tree.parse("".join("  " * i + "/d\n" for i in range(1200)))


def test_every_property_is_checked_but_under_providers_nodes():
    # A node whose name merely began with "providers" escaped every check.
    checked = []
    tree.parse("/providers-site\n  variance = 1\n  /providers\n    k = 2\n"
               "    /h:1\n      pid = 3\n  /workers\n    history = 4\n",
               lambda path, key, value: checked.append((path, key)))
    assert checked == [("/providers-site", "variance"),
                       ("/providers-site/workers", "history")]


class DictReader:
    def __init__(self, nodes):  # path -> Stored
        self.nodes = nodes

    def node(self, path):
        return self.nodes.get(path)

    def children(self, path):
        prefix = path.rstrip("/") + "/"
        return [p[len(prefix):] for p in self.nodes
                if p.startswith(prefix) and p != prefix
                and "/" not in p[len(prefix):]]


def test_plan_is_pure_and_spares_ephemerals():
    reader = DictReader({
        "/": tree.Stored({}, 0, False),
        "/lb": tree.Stored({"variance": 1, "old": 2}, 7, False),
        "/lb/gone": tree.Stored({}, 0, False),
        "/lb/live": tree.Stored({}, 0, False),
        "/lb/live/h:1": tree.Stored({}, 0, True),
        "/lb/h:2": tree.Stored({}, 0, True),
    })
    desired = tree.parse("/lb\n  variance = 4\n  /new\n    a = 1\n")
    changes = tree.plan(reader, desired, "/", delete=True)
    assert [(c.action, c.path) for c in changes] == [
        ("set", "/lb"), ("create", "/lb/new"), ("delete", "/lb/gone"),
        ("skip", "/lb/live")]
    assert changes[0].data == {"variance": 4} and changes[0].version == 7
    assert str(changes[0]) == "set /lb\n  variance = 4 (was 1)\n  remove old = 2"
    without_delete = tree.plan(reader, desired, "/")
    assert without_delete[0].data == {"variance": 4, "old": 2}


def test_zookeepers_own_node_is_never_imported():
    reader = DictReader({"/": tree.Stored({}, 0, False),
                         "/zookeeper": tree.Stored({}, 0, False)})
    with pytest.raises(ConfigurationError, match="/zookeeper is ZooKeeper's own node"):
        tree.plan(reader, tree.parse("/zookeeper\n  a = 1\n"), "/")
    assert [c.action for c in tree.plan(reader, tree.parse("/zookeeper\n"), "/x")] == [
        "create", "create"]
