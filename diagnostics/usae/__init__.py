"""Universal sparse autoencoders (Thasarathan et al. 2025, arXiv 2502.03714).

One shared TopK concept dictionary over M models' activations at a layer (e.g. the IID,
the non-IID global and client models): per model an encoder into the shared concepts and
a decoder out of them. Trained so that any model's code reconstructs every model's
activations, it tells which concepts the models share, which are unique to one, and
whether model i's concepts can drive model j (stitching). Pure torch, no Flower.

- ``model``: ``USAEConfig``, ``USAE``, saving and loading;
- ``activations``: tokens from models' layers, in-memory and streaming sources;
- ``train``: ``train_usae``;
- ``metrics``: R^2 matrix, sparsity, shared/unique concepts, stitching.
"""
