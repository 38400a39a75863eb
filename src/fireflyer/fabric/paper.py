"""The paper's published numbers (arXiv 2408.14158v2), for the reproduction tests, the README
table and the charts. Figure 7 values are chart readings (see the project's research notes);
the rest are stated in the text or tables."""

from __future__ import annotations

MiB = 1 << 20

#: Figure 7's buffer: 186 MiB per GPU.
FIG7_BYTES = 186 * MiB

#: Figure 7a, HFReduce algbw (GB/s) by GPU count, chart readings.
FIG7A_HFREDUCE = {16: 8.10, 128: 7.78, 1024: 6.31, 1440: 6.99}
#: The GPUs a Figure 7 point labelled with a count really ran on: the artifact's "1440 GPUs" job
#: is its 160-node job (submit.sh), 1,280 GPUs.
FIG7_RUN_GPUS = {1440: 1280}

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

#: Figure 8a (VGG16, weak scaling, 50 images per GPU): seconds per step, chart readings.
FIG8A = {"HaiScale DDP (HFReduce)": {32: 0.13, 512: 0.15}, "Torch DDP (NCCL)": {32: 0.27, 512: 0.288}}
#: Figure 8b (GPT-2 medium, FSDP, weak scaling, 32 x 256 tokens per GPU): seconds per step.
FIG8B = {"HaiScale FSDP": {16: 0.57, 32: 0.58, 64: 0.598, 128: 0.595},
         "Torch FSDP": {16: 0.84, 32: 0.985, 64: 0.875, 128: 0.99}}
#: Figure 9a (LLaMA-13B, seq 2048, batch 4096, PP=4): seconds per step.
FIG9A = {64: 64.118, 128: 32.508, 256: 17.448, 512: 9.717}
#: Figure 9b (DeepSeekMoE-16B, seq 4096, batch 4608, PP=10): seconds per step.
FIG9B = {40: 79.615, 80: 40.352, 160: 20.784, 320: 10.71, 640: 6.535}
