"""Transport: how bytes move between ranks, on a node and between nodes.

On a node: the shared-memory ``arena`` (chunk slots and flags), ``mailbox`` byte rings, ``registered``
buffers other ranks read in place, ``fdshare`` (the arena handed over as a file descriptor), ``futex``
waits and ``procs`` (is a peer still alive). Between nodes: authenticated TCP ``links``. Point to
point over both: ``transfers`` (what moves), ``channels`` and ``endpoints`` (how), ``progress`` (a
synchronous call driving its own channels) and ``exchange`` (send/recv, all-to-all, gather, scatter).
"""
