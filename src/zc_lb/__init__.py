"""zc-lb: a résumé-based load balancer for WSGI applications.

The modules of the per-request path that pay for it (``COMPILED``: the
routing pool, the HTTP head's parsing and checks, ejection, the worker
protocol and its connections, the front server's client connections, the
relayed request head, the LB's forwarding and the worker's serving) may run compiled by
mypyc from this same source: ``make`` builds them in place, and
``ZC_LB_COMPILE=1 pip wheel`` builds them into a wheel.  ``ZC_LB_PURE=1``
runs the source even where they are built, and so does a checkout whose
compiled modules are older than their source (``make`` builds them
again); ``build()`` says which runs.  It is all of them or none: a
compiled class cannot derive from an interpreted one.
"""

import importlib.machinery
import importlib.util
import os
import sys

__version__ = "0.1.0"

COMPILED = (
    "environ",
    "front.h1", "front.httpparse", "front.forwarding", "front.client", "front.transport",
    "front.body",
    "lb.outlier", "lb.relay", "lb.balancer", "lb.fleet", "lb.bodies", "lb.stats", "lb.awaiting",
    "routing.pool", "routing.skillmap", "routing.classstats", "routing.locality",
    "routing.slowstart", "routing.members", "routing.placement", "routing.relearn",
    "routing.affinity", "routing.classifier",
    "wire.frames", "wire.encoder", "wire.decoder", "wire.handshake", "wire.stream",
    "wire.protocol", "wire.keepalive", "wire.writer", "wire.exchange", "wire.connection",
    "worker.wsgi", "worker.greenlets", "worker.publisher", "worker.serving", "worker.server",
)

_HERE = os.path.dirname(os.path.abspath(__file__))


def _path(name):
    """The file of module ``name`` (dotted, under this package), less its
    suffix."""
    return os.path.join(_HERE, *name.split("."))


def _built(name):
    """The compiled module ``name`` beside the source, or None: the shared
    library ``_compiled__mypyc`` holds the code, and each module's own is a
    shim that loads it."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = _path(name) + suffix
        if os.path.exists(path):
            return path
    return None


def _checkout():
    """Whether the package runs from a checkout (``src/zc_lb`` beside
    ``setup.py``), not from an installed wheel."""
    return os.path.exists(os.path.join(_HERE, os.pardir, os.pardir, "setup.py"))


def _stale():
    """Whether, in a checkout, the compiled code is older than some of its
    source (in an installed wheel, times say nothing)."""
    library = _built("_compiled__mypyc")
    if library is None or not _checkout():
        return False
    built = os.path.getmtime(library)
    return any(os.path.getmtime(_path(name) + ".py") > built for name in COMPILED)


class _SourceFinder:
    """Finds the ``COMPILED`` modules' source before their compiled form."""

    names = {__name__ + "." + name: name for name in COMPILED}

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        name = cls.names.get(fullname)
        if name is None:
            return None
        return importlib.util.spec_from_file_location(fullname, _path(name) + ".py")


def build():
    """How the ``COMPILED`` modules run: "compiled", or "source" and why:
    as this package found when imported, which is what runs, whatever is
    built or removed beside it since (and read without touching the disk:
    the status document and the metrics ask on every read)."""
    return _BUILD


def _which_build():
    if _built("_compiled__mypyc") is None:
        if _checkout():
            return "source (not compiled: make compile builds it)"
        return "source (installed without compiling: pip install -v says why)"
    if _SourceFinder in sys.meta_path:
        return _pure_reason
    return "compiled"


_pure_reason = None
if os.environ.get("ZC_LB_PURE") == "1":
    _pure_reason = "source (ZC_LB_PURE=1)"
elif _stale():
    _pure_reason = "source (the compiled modules are older than it: make builds them again)"
    sys.stderr.write("zc-lb: the compiled modules are older than their source: running "
                     "the source (make builds them again)\n")
if _pure_reason:
    sys.meta_path.insert(0, _SourceFinder)
_BUILD = _which_build()
