"""Fault injection above the transport seam: fault plans, the session that applies one to a run
(client-fault transport wrappers that keep one ledger row per request, the TCP fault proxy,
engine faults on a managed server), and the bad-input probe (`bench probe bad-input`)."""
