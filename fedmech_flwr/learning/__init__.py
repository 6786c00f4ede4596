"""The learning pieces: named arrays, masks, pruning, the training engine and heads;
below them only the foundation and the models."""
