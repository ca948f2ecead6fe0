"""The amdsmi boundary: AmdSmiBackend over AMD's ``amdsmi`` Python package (or FakeAmdSmi), and the
AMD Instinct device profiles.

Nothing outside this package calls amdsmi, and nothing here imports it at module import: the
backend's ``open_backend`` imports it only when the agent is configured for it (``amdsmi`` or
``auto``), so an NVIDIA node never loads it.
"""
