"""The documentation says what the code does: the generated reference
pages match the code, every ``zc-lb`` command line shown in the README
and docs/ parses with the real parser, and the docs' links lead
somewhere.  Nothing here starts a server."""

import ast
import contextlib
import functools
import glob
import importlib
import importlib.util
import io
import os
import re
import shlex

import pytest

from zc_lb.cli import parsers, reload, tools

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCUMENTS = ["README.rst"] + sorted(
    os.path.relpath(path, ROOT)
    for path in glob.glob(os.path.join(ROOT, "docs", "**", "*.rst"), recursive=True))


def read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def load_generator():
    spec = importlib.util.spec_from_file_location(
        "gen_reference", os.path.join(ROOT, "docs", "gen_reference.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- the generated pages ---------------------------------------------------


@pytest.mark.parametrize("page", ["reference/settings.rst", "reference/cli.rst"])
def test_the_generated_reference_is_up_to_date(page):
    generator = load_generator()
    expected = generator.PAGES[page]()
    assert read(os.path.join("docs", page)) == expected, (
        "docs/%s differs from what the code says; run `make docs` "
        "(python docs/gen_reference.py) and commit the result" % page)


def test_every_setting_is_in_the_settings_reference():
    from zc_lb import settings

    text = read("docs/reference/settings.rst")
    for table in (settings.LB_SETTINGS, settings.WORKER_SETTINGS):
        for name, setting in table.items():
            assert "``%s``\n~~~" % name in text
            if settings.CLI in setting.where:
                assert "``%s" % setting.option in text


# -- command lines ----------------------------------------------------------


def literal_blocks(text):
    """The lines of each ``::`` literal block of ``text``, dedented."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].rstrip().endswith("::"):
            indent = len(lines[i]) - len(lines[i].lstrip())
            i += 1
            block = []
            while i < len(lines) and (not lines[i].strip() or
                                      len(lines[i]) - len(lines[i].lstrip()) > indent):
                block.append(lines[i])
                i += 1
            yield [line.strip() for line in block]
        else:
            i += 1


def joined_lines(block):
    """A literal block's lines, those continued with a backslash joined."""
    joined = []
    for line in block:
        if joined and joined[-1].endswith("\\"):
            joined[-1] = joined[-1][:-1] + " " + line
        else:
            joined.append(line)
    return joined


def before_shell(words):
    """A command line's words up to the shell's (a pipe, a redirection)."""
    argv = []
    for word in words:
        if word in ("|", ">", ">>", "&&", ";", "||", "&"):
            break
        argv.append(word)
    return argv


def command_lines(text):
    """The ``zc-lb ...`` command lines shown in ``text``'s literal blocks,
    continuation lines joined, as argument lists after ``zc-lb``."""
    for block in literal_blocks(text):
        for line in joined_lines(block):
            line = re.sub(r"^\$\s+", "", line)
            words = shlex.split(line, comments=True)
            if not words or not (words[0] == "zc-lb" or words[0].endswith("/zc-lb")):
                continue
            yield line, before_shell(words[1:])


def all_command_lines():
    for path in DOCUMENTS:
        for line, argv in command_lines(read(path)):
            yield pytest.param(argv, id="%s: %s" % (path, line[:60]))


COMMANDS = list(all_command_lines())


def test_the_docs_show_command_lines():
    # (so that a change to how they are found cannot pass by finding none)
    assert len(COMMANDS) >= 20
    shown = {param.values[0][0] for param in COMMANDS if param.values[0]}
    assert {"worker", "lb", "status", "zk", "drain", "compare"} <= shown


def tool_parser(command):
    """The parser of a tool ``zc-lb COMMAND`` passes its arguments to."""
    module = importlib.import_module(tools.PASS_THROUGH[command][0])
    return (getattr(module, "make_parser", None) or getattr(module, "parser"))()


def parse(parser, argv, known=False):
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
            return parser.parse_known_args(argv) if known else (parser.parse_args(argv), [])
    except SystemExit as exc:  # argparse's way to refuse (or --help, --version)
        assert exc.code == 0, "zc-lb %s: %s" % (" ".join(argv), errors.getvalue())
        return None, []


@pytest.mark.parametrize("argv", COMMANDS)
def test_a_command_line_in_the_docs_parses(argv):
    args, rest = parse(parsers.build_parser(), argv, known=True)  # as cli.main does
    if args is None:
        return
    if "pass_through" in args:  # replay, compare, simulate: the tool's own options
        parse(tool_parser(args.command), rest)
    else:
        assert not rest, "zc-lb %s: unrecognized arguments %s" % (" ".join(argv), rest)


@pytest.mark.parametrize("line", ["zc-lb lb --varience 2", "zc-lb wroker app:app",
                                  "zc-lb replay LOG --taget http://127.0.0.1:8080"])
def test_a_misspelt_command_line_fails_the_test_above(line):
    ((_, argv),) = list(command_lines("::\n\n    %s\n" % line))
    with pytest.raises(AssertionError):
        test_a_command_line_in_the_docs_parses(argv)


# The tools beside the package, as the READMEs of playback/ and
# simulations/ run them from a checkout: the first words, and the tool
# (``zc-lb COMMAND``) whose parser takes the rest.
TOOL_COMMANDS = {("playback/compare.py",): "compare", ("playback/replay.py",): "replay",
                 ("-m", "simulations"): "simulate", ("-m", "zc_lb.simulations"): "simulate"}
TOOL_DOCUMENTS = DOCUMENTS + ["playback/README.rst", "simulations/README.rst"]


def tool_command_lines(text):
    """The ``python playback/compare.py ...`` (replay.py, ``-m
    simulations``) command lines of ``text``'s literal blocks, as the
    ``zc-lb`` command that takes the same arguments, and those; a synopsis
    (``[options]``, ``LOG...``) is none."""
    for line, words in python_command_lines(text):
        for start, command in TOOL_COMMANDS.items():
            if tuple(words[:len(start)]) == start:
                argv = words[len(start):]
                if not any(word.startswith("[") or word.endswith("...") for word in argv):
                    yield line, [command] + argv


def python_command_lines(text):
    for block in literal_blocks(text):
        for line in joined_lines(block):
            line = re.sub(r"^\$\s+", "", line)
            if not re.match(r"(\S*/)?python3?\s", line):
                continue
            words = shlex.split(line, comments=True)
            if words:
                yield line, before_shell(words[1:])


TOOL_LINES = [pytest.param(argv, id="%s: %s" % (path, line[:60]))
              for path in TOOL_DOCUMENTS for line, argv in tool_command_lines(read(path))]


def test_the_docs_show_the_tools_command_lines():
    # (so that a change to how they are found cannot pass by finding none)
    assert {param.values[0][0] for param in TOOL_LINES} == {"compare", "replay", "simulate"}
    assert len(TOOL_LINES) >= 20


@pytest.mark.parametrize("argv", TOOL_LINES)
def test_a_tools_command_line_in_the_docs_parses(argv):
    test_a_command_line_in_the_docs_parses(argv)


def test_a_misspelt_tools_command_line_fails_the_test_above():
    text = "::\n\n    python playback/compare.py LOG --warm-up 10\n"
    ((_, argv),) = list(tool_command_lines(text))
    with pytest.raises(AssertionError):
        test_a_tools_command_line_in_the_docs_parses(argv)


def config_examples():
    for path in DOCUMENTS:
        for block in literal_blocks(read(path)):
            block = "\n".join(block).strip().splitlines()
            if block and block[0] in ("[lb]", "[worker]"):
                yield pytest.param("\n".join(block) + "\n", id=path)


CONFIGS = list(config_examples())


def test_the_docs_show_a_config_file():
    assert CONFIGS


@pytest.mark.parametrize("text", CONFIGS)
def test_a_config_file_in_the_docs_is_taken(text, tmp_path):
    from zc_lb import config

    path = tmp_path / "zc-lb.toml"
    path.write_text(text, encoding="utf-8")
    parser = parsers.build_parser()
    for section in ("lb", "worker"):
        if "[%s]" % section in text.splitlines():
            assert config.load(str(path), section, parser.commands[section],
                               reload.COMMAND_SETTINGS[section])


# -- what CI and readers rely on ------------------------------------------------


def test_the_readme_gives_the_command_ci_runs():
    ci = [line for line in read(".ci/run").splitlines()
          if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert ci == ["make test"]
    quick_start = read("README.rst").split("Quick start\n===========\n")[1].split("\n====")[0]
    assert "make run" in quick_start and "make test" in quick_start


def test_the_readme_is_short():
    assert len(read("README.rst").splitlines()) < 400


@pytest.mark.parametrize("path", DOCUMENTS)
def test_the_docs_link_to_files_that_exist(path):
    text = read(path)
    for target in set(re.findall(r"\bdocs/[\w./-]+\.rst\b", text)):
        assert os.path.exists(os.path.join(ROOT, target)), "%s names %s" % (path, target)
    for target in set(re.findall(r"<(docs/[^>]+)>`_", text)):
        assert os.path.exists(os.path.join(ROOT, target)), "%s links %s" % (path, target)


@pytest.mark.parametrize("path", DOCUMENTS + ["playback/README.rst", "simulations/README.rst"])
def test_the_docs_stay_inside_the_repository(path):
    assert "../shared" not in read(path)


# -- references to sections ---------------------------------------------------

# A section named beside its file: (docs/routing.rst, "Several LB
# processes"), README, "Quick start", docs/design.rst ("Failure semantics").
SECTION_REFERENCE = re.compile(
    r'(?<![\w/.-])((?:docs|playback|simulations)/[\w./-]+\.rst|README(?:\.rst)?)'
    r'(?:,\s*|\s*\()"([^"]+)"')
REFERRING = DOCUMENTS + sorted(
    os.path.relpath(path, ROOT) for pattern in (
        "etc/**/*", "src/zc_lb/**/*.py", "playback/*.rst", "simulations/*.rst")
    for path in glob.glob(os.path.join(ROOT, pattern), recursive=True)
    if os.path.isfile(path) and not os.path.islink(path))


def sections(path):
    """The headings of an .rst file, and the terms it defines in *emphasis*
    at the start of a paragraph."""
    lines = read(path).splitlines()
    found = {above.strip() for above, line in zip(lines, lines[1:])
             if above.strip() and line.strip() and set(line.strip()) <= set("=-~^*+#")
             and len(line.strip()) >= len(above.strip())}
    found.update(re.findall(r"(?m)^\*([^*]+)\*", read(path)))
    return {" ".join(title.split()) for title in found}


def test_the_section_references_are_found():
    # (so that a change to how they are found cannot pass by finding none)
    found = [m for path in REFERRING for m in SECTION_REFERENCE.finditer(read(path))]
    assert len(found) >= 10


@pytest.mark.parametrize("path", REFERRING)
def test_a_section_named_beside_its_file_is_there(path):
    for match in SECTION_REFERENCE.finditer(read(path)):
        target = match.group(1) if match.group(1).endswith(".rst") else "README.rst"
        title = " ".join(match.group(2).split())
        assert title in sections(target), "%s names %s, %r" % (path, target, title)


# -- names of the code ----------------------------------------------------------

# The code's own modules by their dotted names: the package's, and the
# folders installed as its zc_lb.playback and zc_lb.simulations (the
# benchmarks stay beside it).
CODE = {"src/zc_lb": "zc_lb", "playback": "playback", "simulations": "simulations",
        "benchmarks": "benchmarks"}
# WSGI environ keys, which read as dotted names and are none
ENVIRON_KEYS = {"wsgi.input", "wsgi.file_wrapper", "wsgi.url_scheme", "wsgi.errors",
                "zc_lb.cache", "zc_lb.request_class"}
FILE_SUFFIXES = {"py", "rst", "json", "txt", "log", "cfg", "ini", "toml", "so", "gz", "png"}
DOTTED = re.compile(r"``([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(\))?``")


@functools.lru_cache(maxsize=None)
def code_names():
    """``{dotted module: names}`` and ``{class: names}``: what each module
    defines or imports at its top, and what each class defines in its body
    or sets on ``self``, read from the source without importing it."""
    modules, classes = {}, {}
    for folder, package in CODE.items():
        for path in glob.glob(os.path.join(ROOT, folder, "**", "*.py"), recursive=True):
            parts = os.path.relpath(path, os.path.join(ROOT, folder))[:-3].split(os.sep)
            if parts[-1] == "__init__":
                parts.pop()
            tree = ast.parse(read(path))
            names = modules.setdefault(".".join([package] + parts), set())
            for node in tree.body:
                if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(node.name)
                elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                    for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                        names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
                elif isinstance(node, (ast.Import, ast.ImportFrom)):
                    names.update((a.asname or a.name).split(".")[0] for a in node.names)
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    members = classes.setdefault(node.name, set())
                    for item in ast.walk(node):
                        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                            members.add(item.name)
                        elif isinstance(item, ast.Name) and isinstance(item.ctx, ast.Store):
                            members.add(item.id)
                        elif (isinstance(item, ast.Attribute) and isinstance(item.ctx, ast.Store)
                              and isinstance(item.value, ast.Name) and item.value.id == "self"):
                            members.add(item.attr)
    for name in list(modules):  # (installed, playback and simulations are zc_lb's)
        if name.startswith(("playback", "simulations")):
            modules["zc_lb." + name] = modules[name]
    for name in modules:  # a package's modules are its names too
        parent, _, child = name.rpartition(".")
        modules.get(parent, set()).add(child)
    return modules, classes


def unknown_code_names(text, modules, classes):
    """The dotted names in ``text`` (``module.Name``, ``a.b.name``,
    ``Class.method``) that start with a module or a class of the code and
    go on to a name it lacks."""
    for match in DOTTED.finditer(text):
        dotted = match.group(1)
        if dotted in ENVIRON_KEYS:
            continue
        *prefix, last = dotted.split(".")
        if last in FILE_SUFFIXES:
            continue
        if len(prefix) == 1 and prefix[0] in classes:
            if last not in classes[prefix[0]]:
                yield dotted
            continue
        owners = [names for module, names in modules.items()
                  if module == ".".join(prefix) or module.endswith("." + ".".join(prefix))]
        if owners and not any(last in names for names in owners):
            yield dotted


CODE_DOCUMENTS = DOCUMENTS + ["playback/README.rst", "simulations/README.rst"]


def test_the_docs_name_the_code():
    # (so that a change to how they are found cannot pass by finding none)
    modules, classes = code_names()
    text = "\n".join(read(path) for path in CODE_DOCUMENTS)
    named = [m.group(1) for m in DOTTED.finditer(text)]
    assert {"connection.Handler", "zc_lb.routing.pool.Pool", "Pool.room"} <= set(named)
    assert not list(unknown_code_names(
        "``connection.Handler``, ``Pool.room``, ``floor.serve_hop``, ``wsgi.input``",
        modules, classes))
    assert list(unknown_code_names("``worker.Worker``, ``Pool.rooms``, ``floor.serve_hops``",
                                   modules, classes)) == [
        "worker.Worker", "Pool.rooms", "floor.serve_hops"]


@pytest.mark.parametrize("path", CODE_DOCUMENTS)
def test_a_name_of_the_code_in_the_docs_is_there(path):
    modules, classes = code_names()
    wrong = list(unknown_code_names(read(path), modules, classes))
    assert not wrong, "%s names %s, which the code lacks" % (path, ", ".join(wrong))
