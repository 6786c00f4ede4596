"""Class circuits (arXiv 2512.23043): learnable channel gates, discovery, metrics, ablation.

A class-c circuit is a set of output channels per gated layer of a ``FedMechModel`` (every
conv/linear layer but the head) that suffices for the model to classify class c. Pure
torch, no Flower: the diagnostic plug-in built on it lives elsewhere.
"""
