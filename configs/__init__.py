"""Reusable YAML fragments (model sizes, data, trainer, strategy, tracking, launch); a package so they ship in the wheel."""
