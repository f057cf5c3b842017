"""``fxshard.Hardware``: the small, explicit machine model the planner prices programs with.

A device has a peak dense flop/s per dtype, a memory (bytes, bandwidth) and links at two
levels: ``"intra_node"`` (NVLink, Infinity Fabric: between the ``devices_per_node`` devices of a
node) and ``"inter_node"`` (the network: one NIC per device). Each peak is a datasheet figure;
what a program achieves of it is a separate, stated factor (``*_efficiency``), so a reader can
see which number came from the vendor and which is a judgement::

    node time   = max(flops / (peak[dtype] * matmul_efficiency),      (mm, bmm, addmm)
                      bytes read + written / (memory_bandwidth * memory_efficiency))
    collective  = steps * link.latency + wire bytes / (link.bandwidth * link_efficiency)

Presets (``Hardware.preset("h100")``): dense peaks (no structured sparsity), memory and links
from the vendors' datasheets, cited on each preset. The efficiency factors are the same for
every GPU preset and were fixed before any comparison with published training results
(``benchmarks/plan_accuracy.py``), from public microbenchmarks rather than from those results:

- ``matmul_efficiency = 0.70``: large bf16 GEMMs reach about 70-80% of the dense peak with
  cuBLAS/hipBLASLt on H100/MI300X-class parts (A100 reaches more, H100 at realistic clocks
  under power limits less); 0.70 is the low end, since a training step's GEMMs are not all
  large and square.
- ``attention_efficiency = 0.50``: FlashAttention-2 reaches about 35-50% of the H100 peak
  forward and backward, FlashAttention-3 about 60-75%; 0.50 sits between them.
- ``memory_efficiency = 0.80``: streaming kernels reach 80-90% of HBM bandwidth.
- ``link_efficiency = 0.75``: NCCL's all-reduce bus bandwidth reaches about 75-85% of the
  NVLink per-direction peak and of a 400 Gb/s NIC for large messages.
- ``op_latency = 4 us``: a CUDA kernel launch from eager PyTorch, added per computing node.

``fxshard.calibrate()`` measures this machine instead (CPU: matmul flop/s, gloo latency and
bandwidth) and sets every efficiency to 1.0 (the measured rate is what is achieved).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

__all__ = ["Hardware", "Link", "PRESETS"]

INTRA, INTER = "intra_node", "inter_node"


@dataclass(frozen=True)
class Link:
    """One link level: bandwidth per device per direction (bytes/s) and the latency of one
    step of a collective (s)."""

    bandwidth: float
    latency: float


@dataclass(frozen=True)
class Hardware:
    """A device and its interconnect; see the module docstring for how it prices a program."""

    name: str
    flops: dict                         # torch.dtype -> peak dense flop/s
    memory_bytes: int                   # device memory (bytes)
    memory_bandwidth: float             # bytes/s
    links: dict                         # "intra_node" / "inter_node" -> Link
    devices_per_node: int
    matmul_efficiency: float = 0.70
    attention_efficiency: float = 0.50
    memory_efficiency: float = 0.80
    link_efficiency: float = 0.75
    usable_memory: float = 0.90         # of memory_bytes: what the allocator can hand out
    #                                     (runtime context, fragmentation: 10% held back)
    op_latency: float = 4e-6            # s per computing node: a kernel launch (eager)
    source: str = ""
    measured: dict = field(default_factory=dict)   # calibrate(): the raw measurements

    def peak(self, dtype: torch.dtype) -> float:
        """Peak flop/s for ``dtype`` (a dtype without its own figure: float32's)."""
        if dtype in self.flops:
            return self.flops[dtype]
        if torch.float32 not in self.flops:
            raise ValueError(f"fxshard.Hardware({self.name}): no peak flop/s for {dtype} nor "
                             f"float32; give flops={{{dtype}: ...}}")
        return self.flops[torch.float32]

    def link(self, level: str) -> Link:
        if level not in self.links:
            raise ValueError(f"fxshard.Hardware({self.name}): no link level {level!r}; "
                             f"links has {sorted(self.links)}")
        return self.links[level]

    @property
    def usable_bytes(self) -> int:
        return int(self.memory_bytes * self.usable_memory)

    def with_(self, **changes) -> "Hardware":
        """A copy with some fields changed (``h100.with_(devices_per_node=4)``)."""
        return replace(self, **changes)

    @staticmethod
    def preset(name: str) -> "Hardware":
        """``"h100"``, ``"h200"``, ``"a100"`` or ``"mi300x"`` (case-insensitive)."""
        key = name.lower().replace("-", "").replace("_", "")
        if key not in PRESETS:
            raise ValueError(f"fxshard.Hardware.preset: unknown hardware {name!r}; use one of "
                             f"{', '.join(PRESETS)} or build fxshard.Hardware(...) yourself "
                             f"(or fxshard.calibrate() for this machine)")
        return PRESETS[key]

    def describe(self) -> str:
        bf16 = self.flops.get(torch.bfloat16, self.peak(torch.float32))
        intra, inter = self.links.get(INTRA), self.links.get(INTER)
        text = (f"{self.name}: {bf16 / 1e12:.0f} TFLOP/s bf16 dense, "
                f"{self.memory_bytes / 2**30:.0f} GiB at {self.memory_bandwidth / 1e12:.2f} "
                f"TB/s, {self.devices_per_node} per node")
        if intra:
            text += f", intra-node {intra.bandwidth / 1e9:.0f} GB/s"
        if inter:
            text += f", inter-node {inter.bandwidth / 1e9:.0f} GB/s"
        return text


_GB = 1e9
_BF16, _FP16, _FP32, _FP8 = torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn

# NVIDIA H100 Tensor Core GPU datasheet (H100 SXM5 column): FP8 1,979, BF16/FP16 989,
# TF32 494.5 TFLOP/s dense (the datasheet's figures are "with sparsity": halved here);
# 80 GB HBM3 at 3.35 TB/s; NVLink 900 GB/s (bidirectional: 450 GB/s per direction).
# Network: DGX H100, one 400 Gb/s ConnectX-7 per GPU = 50 GB/s per direction.
# Latency: NCCL's per-step latency, a few microseconds on NVLink, ~10 us across IB.
H100 = Hardware(
    name="H100 SXM5 80GB",
    flops={_FP8: 1979e12, _BF16: 989e12, _FP16: 989e12, _FP32: 494.5e12},
    memory_bytes=80 * 10**9, memory_bandwidth=3.35e12,
    links={INTRA: Link(450 * _GB, 3e-6), INTER: Link(50 * _GB, 10e-6)},
    devices_per_node=8,
    source="NVIDIA H100 Tensor Core GPU datasheet (SXM5); DGX H100 user guide (8x 400 Gb/s "
           "ConnectX-7)")

# NVIDIA H200 Tensor Core GPU datasheet (H200 SXM): the H100's compute (BF16 989 dense),
# 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s; DGX H200 networking as DGX H100.
H200 = H100.with_(
    name="H200 SXM 141GB", memory_bytes=141 * 10**9, memory_bandwidth=4.8e12,
    source="NVIDIA H200 Tensor Core GPU datasheet (SXM); DGX H200 (8x 400 Gb/s ConnectX-7)")

# NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM): BF16/FP16 312, TF32 156 TFLOP/s
# dense; 80 GB HBM2e at 2,039 GB/s; NVLink 600 GB/s (300 per direction).
# Network: DGX A100, one 200 Gb/s HDR InfiniBand per GPU = 25 GB/s.
A100 = Hardware(
    name="A100 SXM4 80GB",
    flops={_BF16: 312e12, _FP16: 312e12, _FP32: 156e12},
    memory_bytes=80 * 10**9, memory_bandwidth=2.039e12,
    links={INTRA: Link(300 * _GB, 3e-6), INTER: Link(25 * _GB, 10e-6)},
    devices_per_node=8,
    source="NVIDIA A100 Tensor Core GPU datasheet (80GB SXM); DGX A100 user guide (8x 200 "
           "Gb/s HDR)")

# AMD Instinct MI300X data sheet: FP8 2,614.9, BF16/FP16 1,307.4, TF32 653.7 TFLOP/s dense;
# 192 GB HBM3 at 5.3 TB/s; 7 Infinity Fabric links, 896 GB/s aggregate peer bandwidth
# (bidirectional: 448 GB/s per direction). Network: one 400 Gb/s NIC per GPU (the OAM
# platform reference design).
MI300X = Hardware(
    name="MI300X 192GB",
    flops={_FP8: 2614.9e12, _BF16: 1307.4e12, _FP16: 1307.4e12, _FP32: 653.7e12},
    memory_bytes=192 * 10**9, memory_bandwidth=5.3e12,
    links={INTRA: Link(448 * _GB, 4e-6), INTER: Link(50 * _GB, 10e-6)},
    devices_per_node=8,
    source="AMD Instinct MI300X accelerator data sheet; AMD Instinct MI300X platform (8 OAM, "
           "400 Gb/s per GPU)")

PRESETS = {"h100": H100, "h200": H200, "a100": A100, "mi300x": MI300X}
