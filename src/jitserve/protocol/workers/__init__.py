"""Several HTTP front processes over one engine (``jitserve serve --http-workers N``).

The process that runs ``jitserve serve`` owns the models and their devices (the engine: its servers, the
batching, gRPC). It starts N front processes that share the HTTP port (``SO_REUSEPORT``); each decodes and
encodes KServe's ``/infer`` itself (``protocol/http.py``'s ``HttpFront`` over :class:`~.front.RingService`)
and hands the tensors to the engine through a ring of slots in shared memory (``ring.py``), so that the
fronts scale with cores while the batches form across all of them. Every other request a front relays to
the engine's own HTTP application, as ASGI messages (``relay.py``). ``engine.py`` is the engine's side:
the fronts' links, their processes, restarts and drain; ``front.py`` is a front process.
"""
