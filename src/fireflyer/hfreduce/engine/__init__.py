"""The engine: one :class:`~fireflyer.hfreduce.engine.communicator.Communicator` per rank and group, and
the parts that run its collectives.

``communicator`` assembles them; ``jobs`` numbers a rank's collectives and runs them in order on the
engine thread; ``node_stage`` runs one as a pipeline of chunks through the node's arena, and
``trees`` its inter-node stage over two binary trees of nodes; ``fast_door`` and ``node_all_to_all``
are one-call paths through the compiled core (``compiled`` loads it, ``kernels`` wraps its reduce
kernels beside their torch reference, ``slice_reducer`` picks one per slice); ``failures`` and
``watch`` carry the first failure anywhere to every rank.
"""
