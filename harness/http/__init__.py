"""The transport seam, the aiohttp client and the SSE parser every request goes through."""
