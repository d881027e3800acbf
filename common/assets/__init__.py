"""Data files shipped inside the omnirun package: the tiny default model `omnirun generate` runs offline."""
