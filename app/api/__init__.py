"""HTTP layer: routes, dependencies, problem+json rendering."""
