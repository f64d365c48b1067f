"""ZooKeeper: discovery and live settings for many LBs and workers.

``client`` connects (kazoo, gevent) and imports and exports trees,
``recipes`` keeps registrations and watches up across sessions,
``membership`` is how an LB or a worker takes part, and ``tree`` is the
tree text format.
"""
