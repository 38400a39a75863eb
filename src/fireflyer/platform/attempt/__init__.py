"""One attempt of a task, on its nodes: the ``supervisor`` that runs it, the ``starters`` that start its ranks
(locally or through Slurm), ``rank``, the shim each rank starts through (as the task's owner), and ``replicas``,
a fault-tolerant attempt's manager of torchft replica groups.
"""
