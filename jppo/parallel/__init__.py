"""The device mesh, this process's rows and the global arrays, and the processes of a run: starting them, their
compilation cache, and stopping them together on a signal."""
