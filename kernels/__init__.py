"""GPU kernels (Triton). The engine's torch reference path (``engine.attention``) runs where
none are available."""
