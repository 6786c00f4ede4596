"""The data: datasets looked up by name, and how a training set is split among clients."""
