"""fabric: the cluster planner and collective simulator (paper sections III, IV-D, V and IX).

Pure and numpy-only (never torch): plain numbers in, plain numbers out, so it runs at
10,000-GPU scale in well under a second.

* :mod:`~fireflyer.fabric.catalog`: parts presets (nodes, switches, links) in TOML, overridable.
* :mod:`~fireflyer.fabric.topology`: fat-tree sizing, zones joined by bridges, three layers, planes.
* :mod:`~fireflyer.fabric.cost`: price and power; the node comparison of Table II.
* :mod:`~fireflyer.fabric.traffic`: PCIe and host-memory traffic per unit of data, and in bytes as
  hfreduce's engine runs an allreduce on CPU tensors (the allreduce bench's roofline).
* :mod:`~fireflyer.fabric.trees`, :mod:`~fireflyer.fabric.routing`: double binary trees, rings,
  placement of nodes and static routing on the fabric.
* :mod:`~fireflyer.fabric.collectives`: the allreduce model (ring, tree, HFReduce, HFReduce with NVLink).
* :mod:`~fireflyer.fabric.placement`: HAI's zone-aware placement against a naive one.
* :mod:`~fireflyer.fabric.steptime`: a training step's time (compute, DP/PP/EP/FSDP communication,
  overlap, the pipeline bubble) for :mod:`~fireflyer.fabric.workloads`' models, with the one set of
  constants in :mod:`~fireflyer.fabric.constants`.
* :mod:`~fireflyer.fabric.plan`: ``fireflyer plan``; :mod:`~fireflyer.fabric.cli`.
* :mod:`~fireflyer.fabric.paper`: the paper's published numbers, for tests and charts.
"""
