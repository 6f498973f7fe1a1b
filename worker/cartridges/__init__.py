"""Cartridges as the worker serves them: loaded KV prefixes, their composition, fleets, and
the choice of which a request is served behind."""
