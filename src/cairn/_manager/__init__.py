"""CheckpointManager: when to save, what to keep, what to resume from; the evaluator's side (watching a run)."""
