"""Storage tiers of the asynchronous engine (issue 4): RAM now; local, peer and durable to come."""
