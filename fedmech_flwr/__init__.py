"""fedmech-flwr: a Flower app and CLI that runs mechanistic-interpretability diagnostics
after every aggregation round. A plug-in imports ``fedmech_flwr.api``; the rest is the
core's own."""

from fedmech_flwr.plugins import install_old_names

install_old_names()  # the built-in plug-ins' old top-level names, deprecated (fedmech_flwr.plugins)
