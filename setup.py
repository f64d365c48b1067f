import ast
import os
import shutil
import sys
import sysconfig

from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, ExecError, PlatformError

with open("README.rst") as f:
    long_description = f.read()


# The commands that build what is installed (a wheel, an install, the
# extensions in place); metadata, sdists and editable installs need no
# compiled code (make compiles a checkout's: make compile).
BUILDING = {"bdist_wheel", "build", "build_ext", "install"}


def should_compile():
    """Whether to compile ``zc_lb.COMPILED`` with mypyc: ZC_LB_COMPILE=1
    always (make), =0 never; unset, when building what is installed and
    mypyc and a C compiler with Python's headers are here.  Without them
    the build is pure Python, and says so: ``zc-lb --version``, the
    status and ``zc_lb_build_info`` then say "source"."""
    wanted = os.environ.get("ZC_LB_COMPILE")
    if wanted in ("0", "1"):
        return wanted == "1"
    if not BUILDING & set(sys.argv[1:]):
        return False
    missing = []
    try:
        import mypyc.build  # noqa: F401  (mypy is a build requirement: pyproject.toml)
    except ImportError:
        missing.append("mypyc (pip install mypy)")
    compiler = c_compiler()
    if shutil.which(compiler) is None:
        missing.append("a C compiler (%s)" % compiler)
    if not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
        missing.append("Python's headers (python3-dev)")
    if missing:
        sys.stderr.write("zc-lb: WARNING: %s; missing: %s\n" % (PURE, ", ".join(missing)))
        return False
    return True


def c_compiler():
    """The C compiler the build runs: $CC, else the one Python was built
    with (``gcc``, Debian's ``x86_64-linux-gnu-gcc``), not ``cc``."""
    return (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()[0]


PURE = "building the pure-Python zc-lb, which costs some twice the CPU a request"


def compiled_modules():
    """The modules of ``zc_lb.COMPILED`` compiled by mypyc from the same
    source (``should_compile``); ``make`` builds them in place (``setup.py
    build_ext --inplace``), and ZC_LB_PURE=1 runs the source."""
    if not should_compile():
        return []
    from mypyc.build import mypycify

    try:
        return mypycify(["src/zc_lb/%s.py" % name.replace(".", "/")
                         for name in package_constant("COMPILED")],
                        group_name="zc_lb._compiled", opt_level="3")
    except SystemExit:  # (mypyc printed what it rejected, and exits)
        if os.environ.get("ZC_LB_COMPILE") == "1":
            raise
        # A mypy other than the one zc-lb is checked with may reject the
        # source: an install that runs beats none.
        sys.stderr.write("zc-lb: WARNING: mypyc could not compile zc-lb (above); %s\n" % PURE)
        return []


class BuildExt(build_ext):
    """Builds ``zc_lb.COMPILED``; where the C compiler fails on them (one
    that rejects mypyc's C, a broken tool chain), builds the pure-Python
    zc-lb instead, as where there is none, and says so.  ZC_LB_COMPILE=1
    fails instead."""

    def run(self):
        try:
            super().run()
        except (CCompilerError, ExecError, PlatformError):
            if os.environ.get("ZC_LB_COMPILE") == "1":
                raise
            for extension in self.extensions:  # none half built
                path = self.get_ext_fullpath(extension.name)
                if os.path.exists(path):
                    os.remove(path)
            self.extensions = self.distribution.ext_modules = []
            sys.stderr.write("zc-lb: WARNING: the C compiler failed on zc-lb (above); %s\n"
                             % PURE)


def package_constant(name):
    """The constant ``name`` of ``src/zc_lb/__init__.py`` (``COMPILED``,
    ``__version__``), read without importing the package, which is kept
    in that one place."""
    with open("src/zc_lb/__init__.py") as f:
        return next(ast.literal_eval(node.value) for node in ast.parse(f.read()).body
                    if isinstance(node, ast.Assign)
                    and getattr(node.targets[0], "id", None) == name)


setup(
    name="zc-lb",
    version=package_constant("__version__"),
    description="Résumé-based load balancer for WSGI applications",
    long_description=long_description,
    long_description_content_type="text/x-rst",
    license="ZPL-2.1",
    license_files=["LICENSE.txt"],
    # zc_lb from src/; playback and simulations from the top level, installed
    # as zc_lb.playback and zc_lb.simulations (not top-level names that could
    # collide), so that "pip install zc-lb[playback,simulations]" gives zc-lb
    # replay, compare
    # and simulate outside a checkout.
    package_dir={"": "src", "zc_lb.playback": "playback",
                 "zc_lb.simulations": "simulations"},
    packages=find_packages("src") + ["zc_lb.playback", "zc_lb.simulations"],
    # The sample logs are 4.5 MB: small enough to ship, and the shipped
    # scenarios (nasa, elastic) read them.
    package_data={
        "zc_lb.playback": ["README.rst", "logs/*.log", "logs/README.rst", "haproxy/*.cfg"],
        "zc_lb.simulations": ["README.rst", "scenarios/*.json"],
    },
    ext_modules=compiled_modules(),
    cmdclass={"build_ext": BuildExt},
    python_requires=">=3.11",
    # The floors are the oldest releases zc-lb runs on: WebOb 1.8.9 is the
    # first that imports on Python 3.13 (before 1.8.3, not even on 3.10),
    # httptools 0.6.3 the first with set_dangerous_leniencies (front/h1.py).
    install_requires=["gevent>=23", "kazoo>=2.9", "webob>=1.8.9", "orjson>=3.9",
                      "httptools>=0.6.3", "prometheus-client>=0.17",
                      # mypyc_attr: how the compiled protocol treats its messages
                      "mypy_extensions>=1.0"],
    extras_require={
        # selenium drives Debian's chromium (make sysdeps) in the status page's test;
        # PyYAML reads etc/prometheus.yml back; flask is the third-party framework
        # the forwarding headers are tried with (Werkzeug's ProxyFix); pytest-xdist
        # runs the suite in three processes, each with its own ZooKeeper (3.8:
        # --no-loadscope-reorder, which keeps tests/conftest.py's order of the files)
        "test": ["pytest>=7", "pytest-timeout>=2", "pytest-xdist>=3.8", "hypothesis>=6",
                 "mypy>=1.0", "pastedeploy>=3",
                 "selenium>=4.10", "PyYAML>=6", "flask>=2", "docutils>=0.22"],
        # replay and compare need only gevent; the Locust front end
        # (playback/locustfile.py) needs locust and its geventhttpclient.
        "playback": ["locust>=2.20"],
        # the plots; simulate --no-plots needs nothing more
        "simulations": ["matplotlib>=3.7"],
        "paste": ["pastedeploy>=3"],
        # playback's ZODB case (compare --app zodb): the database, its ZEO
        # server, and gunicorn behind HAProxy
        "zodb": ["ZODB>=6", "ZEO>=6", "gunicorn>=21"],
    },
    entry_points={
        "console_scripts": ["zc-lb = zc_lb.cli:main"],
        "paste.app_factory": ["demo = zc_lb.demo:app_factory"],
    },
)
