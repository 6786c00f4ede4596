"""The experiment: its typed, validated config, ready-made checks for registrations,
and what both sides derive from the config and seed (data, partitions, model)."""
