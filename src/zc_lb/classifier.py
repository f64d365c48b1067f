"""Request classifiers: a WSGI environ in, a request class (a string) out.

Specs, as given on the command line or in ZooKeeper:

``host``
    The Host header, lower-cased, without a leading ``www.`` and without a
    port (falls back to SERVER_NAME).
``re:ENVKEY:PATTERN``
    A regular expression with a named group ``class``, searched in
    ``environ[ENVKEY]``; no match (or no such key) gives the empty class.
``module:expr``
    Any importable callable taking the environ, e.g. ``myapp.lb:classify``.

A bad spec raises ConfigurationError at start-up, never per request.
"""

from __future__ import annotations

import importlib
import re
from typing import Callable, Dict

from .errors import ConfigurationError

Classifier = Callable[[Dict[str, object]], str]


def host_classifier(environ: Dict[str, object]) -> str:
    """The Host header, lower-cased, no leading ``www.``, no port."""
    host = environ.get("HTTP_HOST") or environ.get("SERVER_NAME") or ""
    host = str(host).lower()
    if host.startswith("["):  # IPv6 literal: [::1]:8080
        end = host.find("]")
        host = host[: end + 1] if end > 0 else host
    else:
        host = host.partition(":")[0]
    if host.startswith("www."):
        host = host[4:]
    return host


def regex_classifier(envkey: str, pattern: str) -> Classifier:
    """A classifier searching ``pattern`` (with group ``class``) in environ[envkey]."""
    try:
        compiled = re.compile(pattern)
    except re.error as exc:
        raise ConfigurationError("bad classifier regular expression %r: %s" % (pattern, exc))
    if "class" not in compiled.groupindex:
        raise ConfigurationError(
            "classifier regular expression %r has no named group 'class'" % pattern
        )
    search = compiled.search

    def classify(environ: Dict[str, object]) -> str:
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
    """Import ``module:expr``; the expression is attribute access only."""
    module_name, sep, expr = spec.partition(":")
    if not sep or not module_name or not expr:
        raise ConfigurationError("expected module:expr, got %r" % spec)
    try:
        obj: object = importlib.import_module(module_name)
    except (ImportError, TypeError, ValueError) as exc:
        raise ConfigurationError("cannot import %r from %r: %s" % (module_name, spec, exc))
    for name in expr.split("."):
        if not name.isidentifier():
            raise ConfigurationError("bad name %r in %r" % (name, spec))
        try:
            obj = getattr(obj, name)
        except AttributeError:
            raise ConfigurationError("%r has no attribute %r (from %r)" % (obj, name, spec))
    return obj


def get_classifier(spec: str) -> Classifier:
    """Turn a classifier spec into a classifier function."""
    spec = spec.strip()
    if spec == "host":
        return host_classifier
    if spec.startswith("re:"):
        envkey, sep, pattern = spec[3:].partition(":")
        if not sep or not envkey or not pattern:
            raise ConfigurationError(
                "expected re:ENVKEY:PATTERN, got %r" % spec
            )
        return regex_classifier(envkey, pattern)
    obj = import_object(spec)
    if not callable(obj):
        raise ConfigurationError("classifier %r is not callable" % spec)
    return obj  # type: ignore[return-value]
