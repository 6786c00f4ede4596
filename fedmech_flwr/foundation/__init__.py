"""What every other part of the core stands on, importing nothing of fedmech's
outside this folder: errors, text that is safe where it lands, files written
atomically, bounded YAML, the registry, typed configs from plain data, seeds, timing."""
