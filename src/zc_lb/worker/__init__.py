"""The worker: runs a WSGI application for requests forwarded by LBs.

``server`` serves the LBs' links, ``threads`` runs the application in a
pool of threads (``concurrency``: how many at once; ``threadio``: their
bodies through the hub), ``filewrapper`` is ``wsgi.file_wrapper``, and
``resume`` keeps the résumé the worker sends to every LB.
"""
