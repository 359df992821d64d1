"""Scripts that tests run as real subprocesses (exit, SIGTERM, SIGKILL)."""
