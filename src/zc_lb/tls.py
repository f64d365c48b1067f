"""TLS between LBs and workers, both sides verified (mutual TLS).

Across hosts an LB's requests, the responses and the résumés cross the
network; the shared secret (``--secret-file``) authenticates the
handshake but hides nothing.  With TLS every byte of the link is
encrypted, and each side proves itself with a certificate the other
verifies against a CA it was given:

- a worker: ``--tls-cert`` and ``--tls-key`` (its certificate, naming the
  address LBs connect to: a DNS name, or the IP address as a subjectAltName),
  and ``--tls-ca``, the CA whose certificates it accepts from LBs;
- an LB: ``--worker-tls-cert`` and ``--worker-tls-key`` (its client
  certificate), and ``--worker-tls-ca``, the CA of the workers'.

A side given a certificate needs the CA too: half-verified TLS is not
offered.  The shared secret, if any, is checked as before, inside the
encrypted link.  A cleartext peer meets a TLS one with a clear error on
both sides (``connection.looks_like_tls``, and the TLS handshake's own).
Contexts are made once at start (ConfigurationError, one line, for a
file that will not do), and require TLS 1.2 or later.
"""

from __future__ import annotations

from typing import Any, Optional

from zc_lb.errors import ConfigurationError

MIN_VERSION = "TLSv1_2"


def _context(purpose_server: bool, certfile: str, keyfile: Optional[str], cafile: Optional[str],
             what: str) -> Any:
    import gevent.ssl as ssl  # the cooperative module: handshakes must yield

    if not cafile:
        raise ConfigurationError("%s: a certificate without a CA to verify the other side "
                                 "by (mutual TLS: give the CA too)" % what)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if purpose_server
                             else ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion[MIN_VERSION]
    context.options |= ssl.OP_NO_COMPRESSION
    try:
        context.load_cert_chain(certfile, keyfile or None)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigurationError("%s: cannot use certificate %s with key %s: %s" % (
            what, certfile, keyfile or "(in the certificate file)", exc))
    try:
        context.load_verify_locations(cafile)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigurationError("%s: cannot use CA %s: %s" % (what, cafile, exc))
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def worker_context(certfile: Optional[str], keyfile: Optional[str],
                   cafile: Optional[str]) -> Any:
    """The worker's server context (None without a certificate): it
    requires the LB's certificate, signed by ``cafile``."""
    if not certfile:
        if cafile or keyfile:
            raise ConfigurationError("--tls-ca and --tls-key go with --tls-cert")
        return None
    return _context(True, certfile, keyfile, cafile, "--tls-cert")


def lb_context(certfile: Optional[str], keyfile: Optional[str],
               cafile: Optional[str]) -> Any:
    """The LB's client context for its workers (None without a
    certificate): a worker's certificate must be signed by ``cafile``
    and name the address the LB connects to."""
    if not certfile:
        if cafile or keyfile:
            raise ConfigurationError(
                "--worker-tls-ca and --worker-tls-key go with --worker-tls-cert")
        return None
    context = _context(False, certfile, keyfile, cafile, "--worker-tls-cert")
    context.check_hostname = True
    return context
