"""Typed request models and request -> conversation conversion, one module per API."""
