"""Whole-checkpoint tools on top of load and interop: verified copies, verification and diff, restore transforms (rename, drop, fill), the dry run of a load."""
