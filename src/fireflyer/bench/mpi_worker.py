"""One OpenMPI rank of ``fireflyer bench allreduce``: ``mpirun ... python -m fireflyer.bench.mpi_worker SPEC.json``.

:mod:`fireflyer.bench.allreduce` starts these with ``mpirun`` (see
:mod:`fireflyer.bench.allreduce_peers`). Each rank answers the parent's rounds over the
same control socket as the torch ranks (:func:`fireflyer.bench.allreduce_worker.serve`),
reducing fp32 buffers in place with ``comm.Allreduce(MPI.IN_PLACE, buf)`` on a numpy view
of the torch tensor that holds them, so inputs and the exact check are the torch ranks'.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from fireflyer.bench import allreduce_worker
from fireflyer.bench.allreduce_peers import OPENMPI, dtype_note
from fireflyer.bench.skeleton import worker_main


def _setup() -> allreduce_worker.Setup:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    allreduce_worker._inject_fault(comm.Get_rank(), OPENMPI)

    def make_op(buf: Any) -> allreduce_worker.Op:
        view = buf.numpy()
        return lambda: comm.Allreduce(MPI.IN_PLACE, view)

    info = {"dtypes": {OPENMPI: {d: dtype_note(OPENMPI, d) for d in allreduce_worker.DTYPES}},
            "version": MPI.Get_library_version().strip().splitlines()[0]}
    return {OPENMPI: make_op}, comm.Barrier, {}, info


def run(spec: dict[str, Any]) -> None:
    """Serve the parent's rounds as this OpenMPI rank."""
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    world = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
    allreduce_worker.run_rank(spec, rank, world, _setup)


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:], "mpirun ... python -m fireflyer.bench.mpi_worker", run))
