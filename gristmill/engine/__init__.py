"""The CPU control plane: requests, KV blocks, scheduling, the step loop. Imports no torch."""
