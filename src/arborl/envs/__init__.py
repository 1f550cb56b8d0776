"""Environments: sandboxed workspaces for agent episodes (see base.py)."""
