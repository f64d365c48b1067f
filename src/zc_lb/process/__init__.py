"""Processes: what every zc-lb process does around its own work.

``service`` runs an LB or a worker (its secret, signals, reload, drain),
``processes`` runs ``zc-lb lb --processes N``, ``workergroup`` runs
``zc-lb worker -w N``, ``restart`` hands the listening sockets to a new
process (SIGUSR2), and ``loopwatch`` notices a blocked event loop.
"""
