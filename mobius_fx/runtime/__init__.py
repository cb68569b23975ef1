"""The runtime: the Pipeline a compiled model becomes, its devices, stage calls, memory books and the optimizer overlap."""
