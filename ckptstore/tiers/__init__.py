"""The tiers of the engine, each meeting one contract (base.py): RAM staging slots (ram.py), the
local and durable directories (directory.py) and peer replicas on other nodes (peer.py)."""
