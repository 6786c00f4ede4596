"""What runs inside Flower: the ServerApp and ClientApp, the run lifecycle and round protocol,
and the API that gives a user's own Flower app the diagnostics."""
