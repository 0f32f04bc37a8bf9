"""curve_service package."""
