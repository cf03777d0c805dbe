"""Which replica: the routing strategies (:mod:`.routing`), each replica's latency model
(:mod:`.latency`), the hints engines read (:mod:`.hints`)."""
