"""torchbay-mlflow: the 'mlflow' tracker for torchbay.

Importing this package never imports MLflow; see :mod:`torchbay_mlflow.plugin`.
"""

__version__ = "0.1.0"
