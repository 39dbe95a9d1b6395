"""The engine: how K workers train one model, in layers, lowest first.

``transport`` < ``sync`` < ``buckets`` < ``compress`` < ``replicated`` <
``sharded``, ``local`` < ``strategy``: each subpackage may import those to its
left, never one to its right (``sharded`` and ``local`` are siblings and import
neither the other), and nothing here imports ``plan``, ``observe``, ``train`` or
``cli``. ``tests/test_layering.py`` holds both rules. Users import the public
names from ``gradsync`` itself; these paths are the implementation's.
docs/architecture.md describes every module.
"""
