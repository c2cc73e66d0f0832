"""Acceptance-length evaluation of V4.1 DSpark drafts against their target."""
