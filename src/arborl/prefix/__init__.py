"""Prefix trees over token-id sequences (KV prefix cache, tree packing)."""

from arborl.prefix.radix import PrefixMatch, RadixNode, RadixTree

__all__ = ["PrefixMatch", "RadixNode", "RadixTree"]
