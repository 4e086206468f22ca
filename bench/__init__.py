"""Benchmarks: scripts run with ``python -m bench.<name>`` (``python -m bench.run`` runs them all), never timed
tests.

Importing the package sets ``OMP_WAIT_POLICY=PASSIVE`` unless it is set already, before any benchmark imports
torch: on a machine whose cores are shared with other processes, torch's OpenMP threads, which by default spin at
every barrier, lose whole scheduler time slices waiting for a descheduled sibling (measured here: a 128 x 256
matmul took 8 ms with 2 spinning threads against 0.3 ms with 1 thread or passive waiting). XLA's CPU thread pool
does not spin like that, so without it a comparison would measure the machine's load, not the libraries.

A whole trainer run as its user runs it is another matter: TRL's sampling is thousands of small ops, and passive
threads sleep between them (``bench.peers`` measured TRL's GSM8K-shaped step 7.96 s passive against 6.83 s with
the environment the user had). :func:`user_environment` is that environment, captured before the default above,
and a child process started with :data:`OMP_AS_USER_ENV` set keeps its OpenMP setting as it was given.
"""

import os

OMP_AS_USER_ENV = "JPPO_BENCH_OMP_AS_USER"  # set (to anything but "" or "0"): importing bench leaves OpenMP alone
OMP_MODES = ("user", "passive")  # the OpenMP environments of child_environment

_USER_ENVIRONMENT = dict(os.environ)  # before the default below: what the user's own programs would see


def user_environment() -> dict[str, str]:
    """The process environment as it was before this package set its OpenMP default (a copy)."""
    return dict(_USER_ENVIRONMENT)


def child_environment(omp: str) -> dict[str, str]:
    """The environment of a child process that should run as the user runs it: this process's, with
    ``OMP_WAIT_POLICY`` as the user had it before this package set its default (``omp="user"``) or ``PASSIVE``
    (``omp="passive"``), and :data:`OMP_AS_USER_ENV` set so that the child's own import of ``bench`` leaves it so.
    Everything else this process set (``XLA_FLAGS`` of a quick run, ...) is inherited."""
    if omp not in OMP_MODES:
        raise ValueError(f"omp={omp!r}: must be one of {', '.join(OMP_MODES)}")
    env = {key: value for key, value in os.environ.items() if key != "OMP_WAIT_POLICY"} | {OMP_AS_USER_ENV: "1"}
    policy = "PASSIVE" if omp == "passive" else _USER_ENVIRONMENT.get("OMP_WAIT_POLICY")
    return env if policy is None else env | {"OMP_WAIT_POLICY": policy}


if os.environ.get(OMP_AS_USER_ENV, "") in ("", "0"):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
