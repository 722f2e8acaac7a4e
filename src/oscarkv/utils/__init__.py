"""Small helpers with no dependencies beyond torch."""
