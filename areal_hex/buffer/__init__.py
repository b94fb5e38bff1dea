"""The staleness-bounded trajectory buffer: a Redis stream joining rollout and training.

Import the pieces from their modules (`areal_hex.buffer.producer`, `.consumer`, `.codec`,
`.embedded`); this package stays import-light.
"""
