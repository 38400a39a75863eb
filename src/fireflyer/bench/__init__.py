"""The bench wing: every part's benchmark, ``fireflyer bench <part>``.

:mod:`~fireflyer.bench.harness` is the one harness they share (the machine, the result
document, JSON and PNG written atomically, rounds and medians); each other module measures
one part against its baseline. Runtime parts never import this package.
"""
