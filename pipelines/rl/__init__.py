"""The RL side of tune-prompts: the local PPO update of the policy that writes instructions (``ppo``), and
the same job at scale as OpenRLHF's ``train_ppo_ray`` on a GPU Ray cluster (``train_ppo_ray``, ``cluster_job``).

Importing this package imports none of openrlhf, torch or ray; each module imports what it needs.
"""
