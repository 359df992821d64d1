"""The bottom room: primitives any layer may use (checksums, host buffers, a bounded memo, stats and listeners, pausing the garbage collector). Nothing here imports another cairn room."""
