"""The trainer process of parameter-server mode: ``engine`` (``lb.ps.distribute``, a thin driver
calling the step object of its mode, ``modes/``) with ``config`` (``PSConfig``), ``plan`` (the
sharding plan), ``client`` (calls to every server), ``settings`` (connect-time agreement),
``params`` (dense pushes and pulls), ``sparse`` (``SparseEmbedding`` and its lookups),
``communicator`` (async queue, backward-hook pusher), ``recovery`` (riding out a server
restart), ``wrappers`` (``PSModel``, ``PSOptimizer``), ``active_engine`` and ``table_admin``
(``lb.ps.shrink``, ``lb.ps.table_stats``), ``table_configs`` (Strategy sparse-table settings),
and ``kv`` (``KVClient``). Only ``kv`` imports ``longboat.ps.server``: a ``KVClient`` may talk
to in-process servers (``server.local.LocalServers``, ``longboat.kvstore``'s local stores).
"""
