"""The user's state: pytrees flattened to key paths, what each leaf is, per-process values (and how exports name them), and the bridge to JAX arrays and shardings (device boxes, transfers)."""
