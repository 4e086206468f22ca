"""The device mesh, this process's rows and the global arrays, and starting the processes of a run."""
