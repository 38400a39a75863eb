"""The bench wing: every part's benchmark, ``fireflyer bench <part>``.

:mod:`~fireflyer.bench.harness` is the one harness they share (the machine, the result
document, JSON and PNG written atomically, rounds and medians) and
:mod:`~fireflyer.bench.skeleton` the one run each fills in (flags, measurement, report,
document, chart; its ranks' spec and results); each other module measures one part against
its baseline. Runtime parts never import this package.
"""
