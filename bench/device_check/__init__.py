"""The device check (``bash bench/device_check.sh``): time-boxed stages, each a process that writes one JSON file.

``python -m bench.device_check.stages STAGE --out DIR [--cpu]`` runs one stage (``versions``, ``attention``,
``decode_blocks``); ``python -m bench.device_check.runs STAGE ...`` the two training stages (``quickstart``,
``grpo_step``). ``--cpu`` gives every stage tiny shapes (seconds each), CI's rehearsal of the script.
"""
