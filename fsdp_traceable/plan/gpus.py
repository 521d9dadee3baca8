"""Peak numbers of the GPUs a plan can estimate a step time for, and the cost model.

The model (a lower bound, stated in every estimate): compute takes the traced FLOPs
at the GPU's dense bf16 peak; a collective on ``n`` ranks moves ``(n - 1) / n`` of its
buffer per rank (ring all-gather / reduce-scatter; twice that for an all-reduce) over
NVLink when its ranks fit one 8-GPU node, else over the node's network (one NIC per
GPU); ``fully_shard``'s collectives overlap the compute (exposed: what exceeds it),
tensor-parallel ones sit on the compute's critical path (all exposed). With ``P``
pipeline stages and ``M`` microbatches the slowest stage's compute is stretched by the
schedule's bubble, ``(M + P - 1) / M`` (1F1B and GPipe alike), and its sends to the
next stage move over the network when a stage spans a node or more (over NVLink
otherwise), overlapped with the compute like ``fully_shard``'s collectives.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GPUS", "Gpu", "collective_seconds"]

GPUS_PER_NODE = 8


@dataclass(frozen=True)
class Gpu:
    """One GPU's datasheet peaks (dense, no sparsity).

    Attributes:
        bf16_flops: dense bf16 tensor-core FLOP/s.
        hbm_bytes: HBM capacity.
        hbm_bandwidth: HBM bytes/s.
        nvlink_bandwidth: NVLink bytes/s per direction.
        network_bandwidth: inter-node bytes/s per GPU (one 400 Gb/s NIC).
    """

    bf16_flops: float
    hbm_bytes: float
    hbm_bandwidth: float
    nvlink_bandwidth: float
    network_bandwidth: float


GPUS = {
    # https://www.nvidia.com/en-us/data-center/h100/ (SXM: 989 TFLOPS bf16 dense, i.e.
    # half the 1,979 with sparsity; 80 GB at 3.35 TB/s; NVLink 900 GB/s both directions)
    # https://www.nvidia.com/en-us/networking/infiniband-adapters/ (ConnectX-7, 400 Gb/s)
    "h100": Gpu(989e12, 80e9, 3.35e12, 450e9, 50e9),
    # https://www.nvidia.com/en-us/data-center/h200/ (SXM: 989 TFLOPS bf16 dense; 141 GB
    # at 4.8 TB/s; NVLink 900 GB/s both directions)
    "h200": Gpu(989e12, 141e9, 4.8e12, 450e9, 50e9),
    # https://www.nvidia.com/en-us/data-center/dgx-b200/ (8 GPUs: 1,440 GB HBM3e at
    # 64 TB/s, NVLink 5 at 14.4 TB/s, 72 PFLOPS FP8 training, so 2.25 PFLOPS bf16 dense
    # per GPU; 8 ConnectX-7 400 Gb/s ports)
    "b200": Gpu(2.25e15, 180e9, 8e12, 900e9, 50e9),
}


def collective_seconds(gpu: Gpu, kind: str, nbytes: int, ranks: int) -> float:
    """Ring time of one collective of an ``nbytes`` buffer on ``ranks`` ranks."""
    if kind == "recv":  # the sender's transfer, counted there
        return 0.0
    if kind == "send":  # ``ranks``: how far apart the stages' ranks are
        bandwidth = gpu.nvlink_bandwidth if ranks < GPUS_PER_NODE else gpu.network_bandwidth
        return nbytes / bandwidth
    if ranks <= 1:
        return 0.0
    bandwidth = gpu.nvlink_bandwidth if ranks <= GPUS_PER_NODE else gpu.network_bandwidth
    factor = 2 if kind == "all-reduce" else 1
    return factor * (ranks - 1) / ranks * nbytes / bandwidth
