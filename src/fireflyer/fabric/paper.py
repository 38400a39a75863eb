"""The paper's published numbers (arXiv 2408.14158v2), for the reproduction tests, the README
table and the charts. Figure 7 values are chart readings (see the project's research notes);
the rest are stated in the text or tables."""

from __future__ import annotations

MiB = 1 << 20

#: Figure 7's buffer: 186 MiB per GPU.
FIG7_BYTES = 186 * MiB

#: Figure 7a, HFReduce algbw (GB/s) by GPU count, chart readings.
FIG7A_HFREDUCE = {16: 8.10, 128: 7.78, 1024: 6.31, 1440: 6.99}

#: Figure 7a, NCCL: 3.73-4.83 GB/s from 16 to 512 GPUs (a band; points not read one by one), then:
FIG7A_NCCL_BAND = (16, 512, 3.73, 4.83)
FIG7A_NCCL = {1024: 1.63, 1440: 1.65}

#: Figure 7b, HFReduce with NVLink inside one zone.
FIG7B_IN_ZONE = {16: 19.18, 32: 13.0, 64: 12.07, 128: 10.3, 256: 9.66, 512: 8.56, 1024: 7.99}
#: Figure 7b, HFReduce with NVLink across the two fat-tree zones.
FIG7B_CROSS_ZONE = {128: 9.27, 256: 8.63, 512: 8.06, 1024: 7.75}

#: Table II: per-node figures.
TABLE2 = {
    "tf32": (107, 131), "fp16": (220, 263), "relative_performance": 0.83, "relative_price": 0.60,
    "cost_performance": 1.38, "power_w": (2500, 4200),
}

#: Table III: switches, network price, server price, total price for 10,000 GPUs.
TABLE3 = {
    "ours": {"switches": 122, "network": 350, "servers": 11250, "total": 11600},
    "three_layer": {"switches": 200, "network": 600, "servers": 11250, "total": 11850},
    "dgx": {"switches": 1320, "network": 4000, "servers": 19000, "total": 23000},
}
#: III-C: the DGX fabric's layers, and the PCIe three-layer alternative's.
TABLE3_DGX_LAYERS = {"core": 320, "spine": 500, "leaf": 500}
TABLE3_THREE_LAYER_LAYERS = {"core": 40, "spine+leaf": 160}

#: IV-D3: memory traffic per unit of data and the ceilings.
MEMORY_TOTAL = 24
MEMORY_GB_S = 320.0
MEMORY_CEILING_GB_S = 13.3
#: IV-D3: "slightly over 8 GB/s" measured; "about 12 GB/s" after algorithm and network limits.
HFREDUCE_MEASURED_GB_S = 8.0

#: IX: 128-port 400G switches, 4 planes of two-layer fat trees.
MULTIPLANE = {"radix": 128, "planes": 4, "gpus": 32768}

#: VIII-C2: the whole Fire-Flyer 2 draws "just over 3 MW", at most 4 MW.
CLUSTER_POWER_MW = (3.0, 4.0)
