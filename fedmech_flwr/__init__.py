"""fedmech-flwr: a Flower app and CLI that runs mechanistic-interpretability diagnostics
after every aggregation round. A plug-in imports ``fedmech_flwr.api`` and its role modules; the rest is the
core's own."""
