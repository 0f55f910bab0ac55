"""Benchmarks and the research code only they run; a package so that tests import it by one name."""
