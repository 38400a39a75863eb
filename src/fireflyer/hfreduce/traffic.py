"""What one allreduce costs in memory and on the wire, as the engine runs it: the roofline's model.

:func:`algorithm` says which path the engine takes for a message (the size thresholds);
:func:`memory_traffic` counts the bytes that path reads and writes, next to the floor
(each rank's input read once and its output written once: 2L times the message per node).
The benchmark divides both by the message size and prints them beside each time.
"""

from __future__ import annotations

from fireflyer.hfreduce.config import HFReduceConfig, default_chunk_bytes
from fireflyer.hfreduce.topology import tree_links

ONE_SHOT = "one-shot"
PIPELINE = "pipeline"
TREES = "pipeline+trees"


def algorithm(nbytes: int, num_nodes: int, config: HFReduceConfig | None = None) -> str:
    """The path an allreduce of ``nbytes`` per rank (contiguous CPU tensors) takes.

    One node: one shot up to ``oneshot_bytes`` (and within one chunk), else the pipeline.
    Several nodes: the pipeline into the trees, whatever the size.
    """
    config = config or HFReduceConfig()
    if num_nodes > 1:
        return TREES
    chunk = config.chunk_bytes or default_chunk_bytes(num_nodes)
    return ONE_SHOT if nbytes <= min(config.oneshot_bytes, chunk) else PIPELINE


def memory_traffic(nbytes: int, local_size: int, num_nodes: int, itemsize: int = 4, *,
                   path: str | None = None) -> dict[str, float]:
    """Bytes one node moves for an allreduce of ``nbytes`` per rank (CPU tensors), for the roofline.

    ``mem_bytes`` counts reads plus writes through memory, as the engine does them on ``path``
    (default: the pipeline, with the trees when ``num_nodes`` > 1):

    - one shot: every rank copies all of its input into its slot (read + write), then reads
      all L inputs (its own in place) and writes its result: 2LS + L(L+1)S;
    - stage-in: every rank copies all but its own slice into the arena (read + write);
    - reduce: every rank reads its slice from all L inputs and writes one result (in
      the accumulation dtype when the partial sum goes on to the trees);
    - trees (several nodes): each byte sent or received over a socket is copied once
      between user and kernel memory (read + write); every message from a child is
      combined (read two, write one); the root rounds its half into the result (a
      plain fp32 sum writes its last combine straight into the result instead);
    - stage-out: every rank copies the whole result into its tensor (read + write).

    ``floor_mem_bytes``: each rank's input read once and its output written once.
    ``link_bytes``: what the busiest node sends per direction on its NIC.
    """
    L, S, N = local_size, float(nbytes), num_nodes
    floor = 2.0 * L * S
    if path == ONE_SHOT:
        if N > 1:
            raise ValueError("the one-shot path runs on one node only")
        return {"mem_bytes": 2 * L * S + L * (L + 1) * S, "floor_mem_bytes": floor, "link_bytes": 0.0}
    a = 4.0 / itemsize if itemsize < 4 else 1.0  # accumulation bytes per data byte
    stage_in = 2 * (L - 1) * S
    stage_out = 2 * L * S
    reduce = L * S + (a * S if N > 1 else S)
    tree_mem, link = 0.0, 0.0
    if N > 1:
        per_node = []
        for node in range(N):
            sent = received = combine = 0.0
            for t in (0, 1):
                links = tree_links(N, node, t)
                kids = len(links.children)
                half = S / 2
                if links.is_root:
                    if not (a == 1.0 and kids):
                        combine += 2 * half  # round the finished half (read acc, write result)
                else:
                    sent += a * half
                    received += half
                received += kids * a * half
                sent += kids * half
                combine += kids * 3 * a * half
            per_node.append((sent, 2 * (sent + received) + combine))
        link = max(sent for sent, _ in per_node)
        tree_mem = sum(mem for _, mem in per_node) / N
    mem = stage_in + reduce + tree_mem + stage_out
    return {"mem_bytes": mem, "floor_mem_bytes": floor, "link_bytes": link}
