"""The load path: metadata of a checkpoint, the chunk reader (ranged, coalesced, verified reads), read-once routes and waves, and the engine that matches a target and builds arrays."""
