"""Services: the units of work behind the routes, and the agent loop."""
