from setuptools import find_packages, setup

with open("README.rst") as f:
    long_description = f.read()

setup(
    name="zc-lb",
    version="0.1.0",
    description="Résumé-based load balancer for WSGI applications",
    long_description=long_description,
    long_description_content_type="text/x-rst",
    license="ZPL-2.1",
    package_dir={"": "src"},
    packages=find_packages("src"),
    python_requires=">=3.11",
    install_requires=["gevent>=23", "kazoo>=2.9", "webob>=1.8", "orjson>=3.9"],
    extras_require={
        "test": ["pytest>=7", "pytest-timeout>=2", "hypothesis>=6", "mypy>=1.0", "pastedeploy>=3"],
        "playback": ["locust>=2.20"],
        "simulations": ["matplotlib>=3.7"],
        "paste": ["pastedeploy>=3"],
    },
    entry_points={
        "console_scripts": ["zc-lb = zc_lb.cli:main"],
        "paste.app_factory": ["demo = zc_lb.demo:app_factory"],
    },
)
