"""Classifiers the end-to-end tests give LBs (``--classifier classifiers:...``)."""

import time


def blocking(environ):
    """By Host, but blocks the LB for ``?S`` seconds on /block-lb (a site's
    classifier that looks something up the blocking way)."""
    if environ.get("PATH_INFO") == "/block-lb":
        time.sleep(float(environ.get("QUERY_STRING") or 1))
    return environ.get("HTTP_HOST", "")
