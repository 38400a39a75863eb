"""The torch door: hfreduce as the ``torch.distributed`` backend ``"hfreduce"``.

``process_group`` is the ProcessGroup torch calls (collectives), ``point_to_point`` its send/recv,
all-to-all, gather and scatter, ``work`` the Work objects it returns, ``spread`` the collectives that
cross rails (gather, broadcast, reduce-scatter), and ``fault_tolerance`` the same backend as torchft's
reconfigurable process group. Everything here turns torch's calls into the engine's plans; nothing
here moves bytes itself.
"""
