"""A Flower app of its own, FedAvgM on Fashion-MNIST, with fedmech's diagnostics attached."""
