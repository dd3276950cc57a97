"""Pure-PyTorch building blocks shared by the per-variant reference backends."""
