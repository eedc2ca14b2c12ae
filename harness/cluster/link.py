"""The link a disaggregated cluster moves KV blocks over (``cluster.link``), from the
prefill replica that computed a prompt to the decode replica that generates its answer.

Each preset is one GPU's own link in one direction (bandwidth) and the time one transfer
takes before its first byte lands (latency). A replica of ``tp`` GPUs holds ``1/tp`` of
every block on each GPU, and each GPU sends its share over its own link, so a transfer
between a TP-``a`` prefill replica and a TP-``b`` decode replica runs over ``min(a, b)``
links in parallel (the side with fewer GPUs sends or receives everything through them).

- ``nvlink``: 450 GB/s, one direction of NVLink 4's 900 GB/s per H100 SXM5 (NVIDIA H100
  Tensor Core GPU datasheet, "NVLink: 900GB/s", both directions together). P and D on
  the same 8-GPU node.
- ``ib``: 50 GB/s, one NDR InfiniBand port of 400 Gb/s per GPU (NVIDIA ConnectX-7 user
  manual, docs.nvidia.com/networking/display/ConnectX7VPI/Introduction: single-port OSFP
  "NDR 400Gb/s"; a DGX H100 has one such ConnectX-7 per GPU), GPUDirect RDMA.
- ``eth``: 12.5 GB/s, one 100 GbE port per GPU without RDMA (the same manual's
  Ethernet-only dual-port QSFP112 card, "100GbE"): the host stages every block.

Latencies: the GPUDirect RDMA figure, "communications latencies of 3-4 us", against
"30-40 us" when the CPU stages the data (Mellanox, "InfiniBand In-Network Computing
Technology and Roadmap", 2019, slide 4): 4 us for ``ib``, 40 us for ``eth``; no published
figure for one NVLink copy was found, so ``nvlink`` takes the RDMA figure's lower end, 3 us.
Line rates, not measured goodputs: a real transfer engine reaches less (its own
descriptors, notifications, a layout that is not one contiguous run per block), which
``cluster.link_gbs`` / ``cluster.link_latency_us`` give instead.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """One GPU's link: ``bandwidth`` in bytes/s (one direction), ``latency`` in seconds
    per transfer; ``source``: where the figures come from."""

    name: str
    bandwidth: float
    latency: float
    source: str

    def seconds(self, nbytes: float, lanes: int = 1) -> float:
        """One transfer of ``nbytes`` split evenly over ``lanes`` such links."""
        return self.latency + nbytes / (self.bandwidth * lanes)


LINKS: dict[str, Link] = {
    "nvlink": Link("nvlink", 450e9, 3e-6,
                   "NVLink 4: 900 GB/s per H100 SXM5 both ways (H100 datasheet); 3 us: the "
                   "GPUDirect RDMA latency's lower end (no published NVLink copy figure)"),
    "ib": Link("ib", 50e9, 4e-6,
               "NDR InfiniBand 400 Gb/s per GPU (ConnectX-7 user manual); 4 us GPUDirect "
               "RDMA (Mellanox 2019 roadmap slides: 3-4 us)"),
    "eth": Link("eth", 12.5e9, 40e-6,
                "100 GbE per GPU (ConnectX-7 user manual), host-staged: 40 us (Mellanox "
                "2019 roadmap slides: 30-40 us CPU-centric)"),
}
TRANSFERS = ("whole", "layerwise")


def make_link(name: str, gbs: float | None, latency_us: float | None) -> Link:
    """The preset ``name``, with its bandwidth (GB/s) or latency (us) replaced where
    given (``cluster.link_gbs``, ``cluster.link_latency_us``)."""
    base = LINKS[name]
    if gbs is None and latency_us is None:
        return base
    return Link(name, base.bandwidth if gbs is None else gbs * 1e9,
                base.latency if latency_us is None else latency_us * 1e-6,
                "given: " + ", ".join(p for p in (
                    f"{gbs} GB/s" if gbs is not None else "",
                    f"{latency_us} us" if latency_us is not None else "") if p)
                + f" (else {name}'s)")
