"""A training run's directory: step folders (naming, listing, deletion), retention policies, reader leases."""
