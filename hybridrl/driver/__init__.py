"""The driver: the loops a run is (synchronous and asynchronous), what they share (session,
placement, collection, evaluation, checkpoints) and the supervised warm start."""
