"""Benchmarks: scripts run with ``python -m bench.<name>`` (``python -m bench.run`` runs them all), never timed
tests.

Importing the package sets ``OMP_WAIT_POLICY=PASSIVE`` unless it is set already, before any benchmark imports
torch: on a machine whose cores are shared with other processes, torch's OpenMP threads, which by default spin at
every barrier, lose whole scheduler time slices waiting for a descheduled sibling (measured here: a 128 x 256
matmul took 8 ms with 2 spinning threads against 0.3 ms with 1 thread or passive waiting). XLA's CPU thread pool
does not spin like that, so without it a comparison would measure the machine's load, not the libraries.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
