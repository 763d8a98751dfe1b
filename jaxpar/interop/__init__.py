"""Interoperability with other model formats (Hugging Face)."""
