"""Request classifiers: a WSGI environ in, a request class (a string) out.

Specs, as given on the command line or in ZooKeeper:

``host``
    The Host header, lower-cased, without a leading ``www.``, a port or
    the trailing dot of a fully qualified name (falls back to
    SERVER_NAME).
``re:ENVKEY:PATTERN``
    A regular expression with a named group ``class``, searched in
    ``environ[ENVKEY]``; no match (or no such key) gives the empty class.
    An ENVKEY no request can have (``path_info``, ``HTTP_X-TENANT``: not
    upper case, or with a ``-``) is a ConfigurationError.
``module:dotted.name``
    Any importable callable taking the environ, e.g. ``myapp.lb:classify``
    (one whose signature takes no single argument, as a WSGI application
    or a factory of classifiers, is a ConfigurationError).
    It must not block: it runs in the LB's event loop, timed, and is moved
    to threads while it is slow (lb/guard.py).

A classifier may return None: the request has no class, and the pool
sends it to the least loaded worker.  What else it returns is made text
(``as_text``): bytes are read as UTF-8, another object is its str.

Affinity keys (``--affinity-key``) split a class finer, so that requests
for the same page go to the same worker among those skilled in the
class (see routing/affinity.py):

``path``
    The request path, without the query (the default).
``none``
    No key: any skilled worker may take any request of a class.
``re:ENVKEY:PATTERN``
    A regular expression searched in ``environ[ENVKEY]``; the key is its
    named group ``key`` if it has one, else the whole match; no match
    gives no key.

What a classifier or key function receives is a mapping of the
request's variables: PEP 3333's CGI variables (``HTTP_HOST``,
``PATH_INFO``...) and ``wsgi.url_scheme``, as strings, read-only.  From
the LB's own front server it is the request's ``relay.Relay``, which
answers the Host and the path from the checked head and makes the rest
at the first question; from another WSGI server, the environ.

A bad spec raises ConfigurationError at start-up, never per request.

A class longer than ``MAX_CLASS`` characters is cut to that length, its
end a hash of the whole (``bounded_class``): a class is a name kept in
every worker's résumé and in the LB's pool, and a client free to send
8 KiB Host headers must not make those 8 KiB a class.  A class that is
not UTF-8 text (a lone surrogate, as a classifier decoding bytes with
``surrogateescape`` makes) has each such character written as its
escape (``"\\udce9"``): a class is sent to workers, logged, shown and
exposed as UTF-8.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import re
from typing import Callable, Final, Mapping, Optional

from zc_lb.errors import ConfigurationError

Classifier = Callable[[Mapping[str, object]], Optional[str]]
KeyFunction = Callable[[Mapping[str, object]], Optional[str]]

MAX_CLASS: Final = 256  # characters (a DNS name has at most 253)
CLASS_HASH: Final = 16  # hex digits of the hash that ends a class cut short


def bounded_class(rclass: str) -> str:
    """``rclass`` as UTF-8 text (``utf8_text``), or, if longer than
    ``MAX_CLASS``, its start and a hash of the whole, ``MAX_CLASS`` long:
    classes that differ stay apart."""
    if not rclass.isascii():
        rclass = utf8_text(rclass)
    if len(rclass) <= MAX_CLASS:
        return rclass
    digest = hashlib.blake2b(rclass.encode("utf-8"),
                             digest_size=CLASS_HASH // 2).hexdigest()
    return "%s~%s" % (rclass[:MAX_CLASS - CLASS_HASH - 1], digest)


def as_text(value: object) -> Optional[str]:
    """What a classifier or key function returned, as text: None as it
    is, bytes read as UTF-8 (a byte that is not kept as a lone
    surrogate, which ``bounded_class`` writes as its escape), any other
    object its str (``42`` is the class ``"42"``)."""
    if value is None or type(value) is str:
        return value
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", "surrogateescape")
    return str(value)


def utf8_text(name: str) -> str:
    """``name``, its lone surrogates (which UTF-8 cannot encode) written
    as their escapes."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return name.encode("utf-8", "backslashreplace").decode("utf-8")
    return name


def host_classifier(environ: Mapping[str, object]) -> str:
    """The Host header, lower-cased, no leading ``www.``, no port, no
    trailing dot (``example.com.`` names the host ``example.com`` does)."""
    host = environ.get("HTTP_HOST") or environ.get("SERVER_NAME") or ""
    host = str(host).lower()
    if host.startswith("["):  # IPv6 literal: [::1]:8080
        end = host.find("]")
        host = host[: end + 1] if end > 0 else host
    else:
        host = host.partition(":")[0]
    if host.startswith("www."):
        host = host[4:]
    if host.endswith("."):
        host = host[:-1]
    return host


def _compile(pattern: str, what: str) -> "re.Pattern[str]":
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise ConfigurationError("bad %s regular expression %r: %s" % (what, pattern, exc))


def _split_regex_spec(spec: str, what: str):
    envkey, sep, pattern = spec[3:].partition(":")
    if not sep or not envkey or not pattern:
        raise ConfigurationError("expected re:ENVKEY:PATTERN for the %s, got %r"
                                 % (what, spec))
    if "." not in envkey and (envkey.upper() != envkey or "-" in envkey
                              or any(c.isspace() for c in envkey)):
        # (a dotted key is namespaced, as wsgi.url_scheme)
        raise ConfigurationError(
            "no request has the environ key %r (the %s's ENVKEY in %r): environ keys are "
            "upper case, with _ for -, and a header field's is HTTP_ and its name "
            "(HTTP_X_TENANT for X-Tenant)" % (envkey, what, spec))
    return envkey, pattern


def regex_classifier(envkey: str, pattern: str) -> Classifier:
    """A classifier searching ``pattern`` (with group ``class``) in environ[envkey]."""
    compiled = _compile(pattern, "classifier")
    if "class" not in compiled.groupindex:
        raise ConfigurationError(
            "classifier regular expression %r has no named group 'class'" % pattern
        )
    search = compiled.search

    def classify(environ: Mapping[str, object]) -> str:
        value = environ.get(envkey)
        if value is None:
            return ""
        match = search(str(value))
        if match is None:
            return ""
        return match.group("class") or ""

    classify.__name__ = "re:%s:%s" % (envkey, pattern)
    return classify


def import_object(spec: str) -> object:
    """Import ``module:dotted.name``: attribute access from the module,
    nothing else.  Its errors do not repeat ``spec``: ``load_object``
    names it, with what it was to be."""
    module_name, sep, expr = spec.partition(":")
    if not sep or not module_name or not expr:
        raise ConfigurationError("expected module:dotted.name")
    try:
        obj: object = importlib.import_module(module_name)
    except (ImportError, TypeError, ValueError) as exc:
        raise ConfigurationError("cannot import %r: %s" % (module_name, exc))
    where = module_name
    for name in expr.split("."):
        if not name.isidentifier():
            raise ConfigurationError("bad name %r" % name)
        try:
            obj = getattr(obj, name)
        except AttributeError:
            raise ConfigurationError("%s has no attribute %r" % (where, name))
        where += "." + name
    return obj


def load_object(spec: str, what: str, load: Callable[[str], object] = import_object) -> object:
    """``load(spec)`` (``import_object``), a site's ``what`` ("classifier",
    "application"); any failure is a ConfigurationError that names
    ``what`` and ``spec`` (an operator who gave both an application and
    a classifier can tell which), and for a module that raises, or
    exits, as it runs, the short cause and where, not a traceback."""
    import traceback

    try:
        return load(spec)
    except ConfigurationError as exc:
        raise ConfigurationError("cannot load the %s %s: %s" % (what, spec, exc))
    except SyntaxError as exc:
        raise ConfigurationError("cannot load the %s %s: %s (%s, line %s)" % (
            what, spec, exc.msg, exc.filename, exc.lineno))
    except (Exception, SystemExit) as exc:  # (its module raised, or exited, as it ran)
        where = traceback.extract_tb(exc.__traceback__)[-1]
        raise ConfigurationError("cannot load the %s %s: %s: %s (%s, line %s)" % (
            what, spec, type(exc).__name__, exc, where.filename, where.lineno))


def get_classifier(spec: str) -> Classifier:
    """Turn a classifier spec into a classifier function."""
    spec = spec.strip()
    if spec == "host":
        return host_classifier
    if spec.startswith("re:"):
        return regex_classifier(*_split_regex_spec(spec, "classifier"))
    obj = load_object(spec, "classifier")
    if not callable(obj):
        raise ConfigurationError("classifier %r is not callable" % spec)
    try:
        inspect.signature(obj).bind(None)
    except TypeError as exc:
        raise ConfigurationError("classifier %r cannot be called with one argument, the "
                                 "request's variables: %s" % (spec, exc))
    except ValueError:
        pass  # (no signature to read, as some built-ins: called as it is)
    from zc_lb.lb.guard import Guarded  # a site's function: timed, and off the loop if it blocks

    return Guarded(obj)


def path_key(environ: Mapping[str, object]) -> Optional[str]:
    """The request's path, without the query."""
    return str(environ.get("PATH_INFO") or "/")


def no_key(environ: Mapping[str, object]) -> Optional[str]:
    """No affinity key."""
    return None


def regex_key(envkey: str, pattern: str) -> KeyFunction:
    """A key function: group ``key`` (or the whole match) of ``pattern``
    searched in environ[envkey]."""
    search = _compile(pattern, "affinity key").search
    group = "key" if "key" in re.compile(pattern).groupindex else 0

    def key(environ: Mapping[str, object]) -> Optional[str]:
        value = environ.get(envkey)
        match = search(str(value)) if value is not None else None
        return match.group(group) if match is not None else None

    key.__name__ = "re:%s:%s" % (envkey, pattern)
    return key


def get_key_function(spec: str) -> KeyFunction:
    """Turn an affinity key spec (path, none, re:ENVKEY:PATTERN) into a function."""
    spec = spec.strip()
    if spec == "path":
        return path_key
    if spec == "none":
        return no_key
    if spec.startswith("re:"):
        return regex_key(*_split_regex_spec(spec, "affinity key"))
    raise ConfigurationError(
        "affinity key must be path, none or re:ENVKEY:PATTERN, got %r" % spec)
