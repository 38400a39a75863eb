"""HFReduce: CPU-side collectives for commodity GPU and CPU clusters (Fire-Flyer AI-HPC, paper section IV).

``import fireflyer.hfreduce`` registers the torch.distributed backend ``"hfreduce"``.
The direct API is :class:`Communicator` (:func:`engine_of` finds the one behind a torch group); configuration is :class:`HFReduceConfig`, which
(with :mod:`~fireflyer.hfreduce.config`'s readers) is the only reader of the environment
variables named in :mod:`~fireflyer.hfreduce.env`.
"""

from fireflyer.hfreduce.config import HFReduceConfig, node_key
from fireflyer.hfreduce.engine.communicator import Communicator
from fireflyer.hfreduce.errors import CollectiveMismatch, CollectiveTimeout, HFReduceError, PeerFailure
from fireflyer.hfreduce.backend.process_group import BACKEND, HFReduceProcessGroup, engine_of, register
from fireflyer.hfreduce.plans.plan import Op

register()

__all__ = [
    "BACKEND",
    "CollectiveMismatch",
    "CollectiveTimeout",
    "Communicator",
    "HFReduceConfig",
    "HFReduceError",
    "HFReduceProcessGroup",
    "Op",
    "PeerFailure",
    "engine_of",
    "node_key",
    "register",
]
