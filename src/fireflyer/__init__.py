"""fireflyer: the Fire-Flyer AI-HPC software stack on PyTorch."""

__version__ = "0.1.0"
