"""Inline-PTX primitives (mma.sync, wgmma, copies, ldmatrix, cp.async, ex2), each with its
simulator twin."""
