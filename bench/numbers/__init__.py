"""Generators of the numbers README.md and docs/ quote (``python -m bench.numbers.<name>``): not benchmarks of a
side-by-side comparison but the runs and plans whose results the pages cite, regenerated when what they measure
changes. ``docs_numbers`` writes ``docs/measured/`` (and runs ``sft_to_rl``); ``plan_table`` prints the README's
planned-memory table; ``routing_replay`` the mismatch table of docs/algorithms.md."""
