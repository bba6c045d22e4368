"""The network fronts: the Open Inference Protocol (KServe v2) over HTTP and gRPC.

Needs the ``http`` extra: ``pip install 'jitserve[http]'``.
"""
