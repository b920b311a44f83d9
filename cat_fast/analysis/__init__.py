"""Analyses of trained models (causal mediation analysis of neurons: planned, docs/METHODS.md §3)."""
