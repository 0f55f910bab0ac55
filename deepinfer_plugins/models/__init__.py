"""Model implementations (framework-neutral)."""
