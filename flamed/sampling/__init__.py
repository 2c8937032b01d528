"""Sampling helpers that know the programs being sampled (interpreters, runtimes)."""
