"""The worker: runs a WSGI application for requests forwarded by LBs.

``server`` is the worker, composing its parts: ``lbs`` admits and keeps
the LBs' connections, ``greenlets`` gives each request a greenlet,
``serving`` runs the application for it (``wsgi``: PEP 3333's environ,
input and response), ``threads`` runs the application in a pool of
threads (``concurrency``: how many at once; ``threadio``: their bodies
through the hub), ``filewrapper`` is ``wsgi.file_wrapper``, ``resume``
keeps the résumé the worker sends to every LB, and ``publisher`` sends
it.
"""
