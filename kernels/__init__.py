"""GPU kernels (Triton). The engine's torch reference path (``weir.engine.attention``) runs where
none are available."""
