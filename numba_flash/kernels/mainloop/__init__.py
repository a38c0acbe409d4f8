"""The stages of one K/V tile step: visibility (the mask), tile scores, the online softmax, the
tile walk, the warp GEMM."""
