"""megatron-edu: the parallelism of the Megatron-LM papers, readable and tested against serial.

Shoeybi et al. 2019 (arXiv 1909.08053): tensor parallelism.
Narayanan et al. 2021 (arXiv 2104.04473): pipeline and data parallelism and their composition.
"""

__version__ = "0.1.0"
