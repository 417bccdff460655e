"""The ``accelerate`` command line as torchbay serves it: ``accelerate launch``, ``config``, ``env``,
``estimate-memory``, ``test`` and the commands plugins serve, each on top of the ``torchbay`` commands
(:mod:`torchbay.cli`)."""
