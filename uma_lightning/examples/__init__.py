"""Small examples the tutorials run, shipped with the package so they run from an installed wheel."""
