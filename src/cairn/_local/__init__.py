"""The local tier: frequent checkpoints in a fast per-host directory, replicated to peer processes, restored from the nearest copy."""
