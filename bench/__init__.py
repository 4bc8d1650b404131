"""Benchmarks that keep the project's measured choices checkable (see DESIGN.md)."""
