"""Hostile clients against `tierproxy serve` itself (uvloop, aiohttp's C parser)."""
