"""Attention for context parallelism: kernels with LSE (``kernels``), the sequence layouts
(``layout``) and the context-parallel algorithms (``context_parallel``)."""
