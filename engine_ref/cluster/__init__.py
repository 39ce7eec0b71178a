"""The cluster room: a router in front of N reference-engine workers, and KV links between
reference engines.

`bench serve --replicas N --router POLICY` starts N ordinary reference servers as worker
processes on loopback (`replicas`) and serves one OpenAI-compatible API in front of them
(`router`), choosing a worker per request by a policy (`routing`). The room reaches the
serving layer only through its public `engine_ref.serving.*` modules, and the engine core only
through `engine_ref.serving.interface`, so a worker is exactly the single server a user would
run by hand. This package imports none of its modules: import the one you need.
"""
