"""Command-line client and load tools for Tandem's Triton models."""
