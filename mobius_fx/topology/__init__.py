"""The server: its GPUs, links and host, described, detected and validated."""
