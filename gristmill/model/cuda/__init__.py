"""CUDA parts: Triton kernels (they also run on CPU under TRITON_INTERPRET=1, which is how
CI tests them) and CUDA graphs for decode steps."""
