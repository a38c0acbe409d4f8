"""The attention forward: the SIMT kernel (simt), mma.sync (mma) and Hopper wgmma (wgmma)."""
