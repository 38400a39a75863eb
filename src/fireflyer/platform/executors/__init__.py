"""Where attempts run: the ``Executor`` Protocol and what it launches (``base``), the ``local`` executor (the
embedded default, every emulated node this machine) and the ``slurm`` one (one batch job per attempt).
"""
