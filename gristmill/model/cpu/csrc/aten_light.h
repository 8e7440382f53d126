// The parts of ATen the kernels use: tensors (with their methods, new_empty included) and
// parallel_for. <torch/extension.h> pulls in all of libtorch's C++ API and pybind11 and
// takes 20-40 s to compile per file on a laptop core; these take about 2 s. Only
// bindings.cpp includes pybind11 (with torch's casters for at::Tensor).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
