"""The torchbay device conformance kit against the 'mps' device (skips where there is none)."""

from torchbay.testing.conformance import *  # noqa: F401,F403

CONFORMANCE_DEVICE = "mps"
