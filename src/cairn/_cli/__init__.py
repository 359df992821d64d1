"""The `cairn` command line (ls, inspect, verify, diff, convert, cp, mv, plan, gc)."""
