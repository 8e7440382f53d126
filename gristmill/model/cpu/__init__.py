"""CPU-only parts: the C++ kernels and their build, int8 / q4 linear layers, the decode stack."""
