"""Kernels: pure-torch references and Triton kernels behind one dispatcher."""
