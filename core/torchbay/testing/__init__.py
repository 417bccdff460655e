"""Test support shipped with torchbay: process helpers and the device conformance kit."""
