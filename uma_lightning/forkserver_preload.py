"""Listed in multiprocessing's forkserver preload, so imported only in the forkserver process.

The forkserver that forks loader workers and RL actors is a child of the training process and lives
in its process group. A stop signal to the whole group would end it (it keeps only SIGINT away), and
the training process would then take every worker for dead and could start no new one. Like the
workers, it ignores these signals; it exits when the training process does.
"""

from uma_lightning.stop_signals import ignore_stop_signals

ignore_stop_signals()
