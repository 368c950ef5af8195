"""One-off probes of a machine or a path (copy threads, a lease, the paged restore's fixed time)."""
