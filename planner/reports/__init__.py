"""Human-readable reports of a plan."""
