"""The jobs of tune-prompts: CLI, config, tasks and data, generation, scoring on Ray, the policy update, the tuning loop."""
