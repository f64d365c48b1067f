"""The LB: the WSGI application that forwards each request to a worker.

``balancer`` forwards requests and their responses, ``bodies`` moves
their bodies (and counts what a drain waits for), ``stats`` counts
requests, errors and latency for the status document, ``fleet`` holds
the workers (who of them is in the pool, drains, ejection, health
checks, the keys relayed between LBs), ``links`` keeps one connection
to each worker address, ``relay`` is the
request head as the front checked it, ``spool`` holds a response for a
slow client, and ``outlier`` ejects a worker that fails where its peers
do not.
"""
