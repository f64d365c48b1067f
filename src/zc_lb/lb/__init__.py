"""The LB: the application that forwards each request to a worker.

``balancer`` forwards requests and their responses, ``bodies`` moves
their bodies (and counts what a drain waits for), ``awaiting`` times
out responses that do not start and watches their clients, and
``stats`` counts requests, errors and latency for the status document.
``fleet`` holds the workers (who of them is in the pool, drains,
ejection, health checks, the keys relayed between LBs), ``links`` keeps
one connection to each worker address, and ``outlier`` ejects a worker
that fails where its peers do not.  ``relay`` is the request head as the
front checked it, and ``spool`` holds a response for a slow client.
``guard`` runs a site's own classifier on the loop, timed, and moves it
to threads if it blocks.
"""
