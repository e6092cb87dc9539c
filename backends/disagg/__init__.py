"""Disaggregated prefill/decode: moving KV pages between engine processes (NIXL)."""
