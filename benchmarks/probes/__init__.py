"""The probes: single questions about cairn's speed, each a module with `main(argv)`, run by name.

    python -m benchmarks.probe                 # the list below
    python -m benchmarks.probe NAME --help     # one probe's options
    python -m benchmarks.probe NAME [--options]

The comparison against Orbax and DCP across sizes is the harness (`python -m benchmarks.run`,
`make bench`); a probe measures one thing the harness does not. Their recorded output is under
benchmarks/results/, and docs/PERFORMANCE.md gives the command behind each figure it shows.
"""

from __future__ import annotations

#: name -> (module under benchmarks.probes, what it measures)
PROBES: dict[str, tuple[str, str]] = {
    "codecs": ("codecs", "ratio and speed of each codec per leaf kind of a trained state, and bytes against Orbax"),
    "native_codecs": ("native_codecs", "the C-Blosc2 codecs against planes, on 1..n threads"),
    "compression": ("compression", "compression False / True / \"auto\": bytes, save and load time per storage"),
    "save_stages": ("save_stages", "where a save's time goes, stage by stage"),
    "load_stages": ("load_stages", "where a load's time goes, stage by stage, onto a device or into numpy"),
    "small_leaves": ("small_leaves", "thousands of small leaves, as many checkpointables or nested in one"),
    "gpu_save": ("gpu_save", "saves and loads from accelerator memory, against Orbax"),
    "restart_load": ("restart_load", "a fresh process's first load and its second, against Orbax"),
    "incremental": ("incremental", "incremental against full saves: bytes, save and load time"),
    "local_tier": ("local_tier", "the local tier against the persistent tier, and recovery from a peer"),
    "read_once": ("read_once", "read-once and direct resharded loads on real processes, against Orbax"),
    "plan_scale": ("plan_scale", "planning and index work for a simulated 4,096-device cluster"),
    "coord_scale": ("coord_scale", "coordination calls and bytes modelled to 1,024 processes"),
    "objstore": ("objstore", "loads and saves on object-store emulators against the best raw requests"),
    "objstore_ab": ("objstore_ab", "the same, two source trees alternated in one run"),
    "link_ceiling": ("link_ceiling", "what the shaped test link carries by itself"),
    "soak": ("soak", "steady-state memory of a training loop that saves every step"),
    "profile_cairn": ("profile_cairn", "profiles one cairn operation on the harness's state"),
}
