"""What a user runs before a run, on any machine: the per-device memory plan, every program compiled for a target
with no accelerator, and the audit of the contract. It sits above :mod:`jppo.run` and builds with the run's own
builders, so what it plans, compiles and audits is what the run runs."""
