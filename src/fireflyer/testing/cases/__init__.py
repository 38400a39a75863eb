"""Rank-side case modules for the multi-process tests: the functions a test hands to ``LocalCluster.run``.

They live in the package (not next to the tests) so that every spawned rank imports them by the same
module name, ``fireflyer.testing.cases.<name>``, whatever the test's directory or ``sys.path``.
"""
