"""The switch that makes torchbay answer ``import accelerate`` (``finder``) and Accelerate's whole public surface
under it (``surface``). Low in the layers, so that anything that asks whether the switch is on (a tracker, the
launch plan) can; what the switch serves lives in :mod:`torchbay.compat` and :mod:`torchbay.cli.accelerate`."""
