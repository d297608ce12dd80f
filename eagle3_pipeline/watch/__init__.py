"""Watching a pipeline's inference servers: the health gate — its config → the host to probe, the server
to check, the thresholds (:mod:`.monitor`) — and the notifications sent when things change for the worse
(:mod:`.alerts`)."""
