"""The platform's state and its pure decisions: the SQLite ``store`` (nodes, quotas, tasks and their chains,
events), the ``policy`` (a snapshot in, decisions out, no I/O and no clock) and ``simulate`` (a day on a
simulated cluster under that policy or FIFO).
"""
