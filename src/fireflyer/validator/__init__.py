"""Node health checks and failure-log (Xid, InfiniBand) analysis (paper §VII-B, §VII-C)."""
