"""Prefix trees over token-id sequences (KV prefix cache, P1; tree packing, P2)."""

from arborl.prefix.common import common_prefix_len
from arborl.prefix.radix import PrefixMatch, RadixNode, RadixTree

__all__ = ["common_prefix_len", "PrefixMatch", "RadixNode", "RadixTree"]
