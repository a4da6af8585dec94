"""latentforge: train a Stable-Diffusion-class text-to-image model from scratch on your own images."""

__version__ = "0.1.0"
