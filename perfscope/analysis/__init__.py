"""Analyses: small named functions over a store, one signature, registered in one place."""
