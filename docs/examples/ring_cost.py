"""The cost model of docs/ring-attention.md: per ring step, bytes sent against FLOPs computed.

    python docs/examples/ring_cost.py

In one step each rank sends one K/V shard to its neighbour and receives one, and computes its
queries against the shard it holds:

* bytes sent:  2 * B * Hkv * N_local * d * itemsize           (K and V)
* FLOPs:       4 * B * H * N_local^2 * d                      (Q K^T and P V, no mask)
               2 * B * H * N_local^2 * d                      (causal, zig-zag: half a block)

The transfer hides behind the compute when bytes / bandwidth <= FLOPs / throughput, i.e. for
shards of at least

    N_local >= (throughput / bandwidth) * (Hkv / H) * itemsize * 2 / c

with c = 4 (no mask) or 2 (causal)

tokens (B and d cancel).  The backward sends K/V (itemsize) and the dK/dV accumulators (float32)
and computes 2.5x the forward FLOPs, so its threshold is (itemsize + 4) / (2.5 * itemsize)
times the forward's.  Per-message latency (microseconds) is left out: it matters only for tiny
B * H.  The throughputs are the H200 figures measured on 2026-11-30 (performance issues of this
repository): 13.0 TFLOP/s for this package's fp32 forward, 453 TFLOP/s for torch SDPA fp16
(tensor cores); the bandwidths are nominal per-direction link rates, not measured here.
"""

from __future__ import annotations

#: nominal per-direction bandwidths in bytes/s (a ring uses each link in one direction)
LINKS = {"NVLink 4 (H100/H200), 450 GB/s": 450e9, "InfiniBand NDR 400 Gb/s, 50 GB/s": 50e9}
#: single-GPU compute throughput (FLOP/s) and the itemsize it runs at, measured on one H200
COMPUTE = {"numba_flash fp32 forward, 13.0 TFLOP/s": (13.0e12, 4),
           "torch SDPA fp16, 453 TFLOP/s": (453e12, 2)}


def step_bytes(b, hkv, n_local, d, itemsize):
    """Bytes one rank sends per forward step: its K and V shard."""
    return 2 * b * hkv * n_local * d * itemsize


def step_flops(b, h, n_local, d, causal):
    """FLOPs one rank computes per step (causal zig-zag: every step is half a block)."""
    return (2 if causal else 4) * b * h * n_local * n_local * d


def hiding_length(throughput, bandwidth, h, hkv, itemsize, causal, backward=False):
    """Smallest N_local at which one step's compute takes as long as its transfer."""
    n = (throughput / bandwidth) * (hkv / h) * itemsize * 2 / (2 if causal else 4)
    if backward:
        n *= (itemsize + 4) / (2.5 * itemsize)
    return n


def table():
    rows = ["| compute side (one H200) | link | heads H:Hkv | no mask | causal "
            "| backward, causal (same throughput) |",
            "|---|---|---|---:|---:|---:|"]
    for cname, (flops, itemsize) in COMPUTE.items():
        for lname, bw in LINKS.items():
            for h, hkv in ((1, 1), (8, 1)):
                cells = [hiding_length(flops, bw, h, hkv, itemsize, causal, bwd)
                         for causal, bwd in ((False, False), (True, False), (True, True))]
                rows.append(f"| {cname} | {lname} | {h}:{hkv} | "
                            + " | ".join(f"{c:,.0f}" for c in cells) + " |")
    return "\n".join(rows)


def example(b=1, h=32, hkv=8, n_local=8192, d=128, itemsize=2, causal=True):
    """One step of a long-context fp16 layer at torch's measured rate, on each link."""
    nbytes = step_bytes(b, hkv, n_local, d, itemsize)
    flops = step_flops(b, h, n_local, d, causal)
    compute_s = flops / COMPUTE["torch SDPA fp16, 453 TFLOP/s"][0]
    lines = [f"B={b} H={h} Hkv={hkv} N_local={n_local} d={d} fp16 causal: "
             f"{nbytes / 2**20:.0f} MiB sent, {flops / 1e12:.2f} TFLOP per step; "
             f"compute {compute_s * 1e3:.2f} ms at 453 TFLOP/s"]
    for lname, bw in LINKS.items():
        lines.append(f"  {lname}: transfer {nbytes / bw * 1e3:.2f} ms")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
    print()
    print(example())
