"""Programs that print figures: hot-path cost, cache value, drift guard cost, races, worst cases."""
