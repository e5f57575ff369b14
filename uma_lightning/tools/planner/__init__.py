"""``uma plan``: choose a parallel layout from the model, the batch and the cluster.

- ``model.py``: what the planner reads from the model (shapes, FSDP units, tp splits, FLOPs);
- ``cluster.py``: accelerators and links;
- ``layout.py``: a layout and the candidates for a world size;
- ``memory.py``: per-rank model state (exact), activations and buffers;
- ``comm.py``: the collectives of a step and their alpha-beta times;
- ``estimate.py``: step time and throughput of a layout, and the ranking;
- ``calibrate.py``: the achievable fraction of peak, from a finished run's logged MFU;
- ``report.py``, ``tool.py``: the printout, JSON, fragment, chart, and the command;
- ``check.py``: predictions against a real step on gloo processes (tests, benchmarks/planner.py).
"""
