"""The WSGI environ keys zc-lb sets and reads, each named once here.

An application behind a worker sees two of them, and may set a third:

- ``REQUEST_CLASS`` (``zc_lb.request_class``): the request's class, as
  the LB's classifier gave it; the worker counts the request in its
  résumé under it.
- ``WORKER`` (``zc_lb.worker``): the worker's own address, as LBs reach
  it (in the LB's environ, the worker that answered, for the access
  log).
- ``CACHE`` (``zc_lb.cache``): set by an application that knows whether
  its cache held what the request needed ("hit" or True, "miss" or
  False); the worker tells the LB, whose measure of locality then
  stands on it (docs/howto/application.rst, "Telling the LB what the
  cache did").

The rest pass between the front server and the LB within one process,
for the LB's work and the access log (the LB answers through the front's
``Responder``, front/forwarder.py, not through the environ):

- ``RELAY``: the request head as the front checked it (``lb.relay``);
- ``FORWARD``: the forwarding variables, for an application that is not
  the LB;
- ``CLASS``, ``COUNTED_CLASS``: the class the LB routed by, and the one
  it counted the latency under (bounded in number);
- ``UPSTREAM_TIME``, ``RETRIES``, ``RETRY_REFUSED``, ``ERROR``: the
  worker's time, the retries, why a retry was refused, and the error,
  for the access log.
"""

from typing import Final

REQUEST_CLASS: Final = "zc_lb.request_class"
WORKER: Final = "zc_lb.worker"
CACHE: Final = "zc_lb.cache"
RELAY: Final = "zc_lb.relay"
FORWARD: Final = "zc_lb.forward"
CLASS: Final = "zc_lb.class"
COUNTED_CLASS: Final = "zc_lb.counted_class"
UPSTREAM_TIME: Final = "zc_lb.upstream_time"
RETRIES: Final = "zc_lb.retries"
RETRY_REFUSED: Final = "zc_lb.retry_refused"
ERROR: Final = "zc_lb.error"
