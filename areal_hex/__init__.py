"""areal-hex: asynchronous RL for LLMs on heterogeneous GPUs.

Importing the package is cheap: torch, transformers and deepspeed are imported lazily by
the modules that need them.
"""

__version__ = "0.1.0"
