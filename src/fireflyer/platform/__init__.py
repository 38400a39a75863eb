"""HAI Platform: a time-sharing scheduler for whole-node tasks (in progress: the policy core)."""
