// Work split between threads by a shared counter: each thread takes the next item as it
// finishes one. A static split (at::parallel_for's) gives each thread an equal share and
// then waits for the slowest; on a machine where other processes take turns on the cores,
// a thread that loses its core for a few milliseconds holds every other thread up that
// long. Here the threads that keep running take its share instead.
#pragma once

#include "aten_light.h"

#include <algorithm>
#include <atomic>
#include <cstdint>

// item(i) for each i < n, on at::get_num_threads() threads; each i runs once, on
// whichever thread takes it first. Within a parallel region (or on one thread), in order.
template <typename Item>
void parallel_items(int64_t n, const Item& item) {
  const int64_t threads = std::min<int64_t>(n, at::get_num_threads());
  if (threads <= 1 || at::in_parallel_region()) {
    for (int64_t i = 0; i < n; ++i) item(i);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n;
         i = next.fetch_add(1, std::memory_order_relaxed))
      item(i);
  });
}
