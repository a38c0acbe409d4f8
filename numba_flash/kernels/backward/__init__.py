"""The attention backward: the SIMT kernels (simt), mma.sync (mma) and the user-function gradients
(aux_grad)."""
