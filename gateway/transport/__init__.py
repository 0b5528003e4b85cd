"""The aiohttp seam: every use of aiohttp's private attributes or overrides of its classes lives
in this package, behind a narrow interface, pinned by tests that fail first on an upgrade."""
