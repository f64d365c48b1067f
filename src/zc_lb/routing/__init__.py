"""Routing: which worker gets a request.

``classifier`` gives a request its class (a site's own runs under
``lb.guard``); ``pool`` is the published résumé algorithm and
``affinity`` the default policy built on it (both hold their workers'
skills in a ``skillmap``), with its parts:
``members`` (which workers serve a class), ``placement`` (where a key
goes among them), ``classstats`` (what it sees of classes and keys),
``locality`` (what keeping a key where its data is buys), ``slowstart``
(an added worker eased in), ``relearn`` (a changed classifier followed)
and ``siblings`` (the processes of one LB routing as one).  ``policies``
names them.
"""
