"""Builds torchbay with ``torchbay_as_accelerate.pth`` at the top of site-packages (metadata lives in setup.cfg).

The ``.pth`` line runs at every interpreter start and does nothing unless ``TORCHBAY_AS_ACCELERATE`` is on; then it
lets torchbay answer ``import accelerate`` (torchbay/switch/finder.py). A ``.pth`` must sit beside the packages, not
inside one, so it is copied into the wheel's root: by ``build_py`` for a regular wheel, and into the editable wheel
for ``pip install -e``.
"""

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "torchbay_as_accelerate.pth"
PTH_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "core", PTH)


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        self.copy_file(PTH_SOURCE, os.path.join(self.build_lib, PTH), preserve_mode=0)

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


commands = {"build_py": BuildPyWithPth}
try:  # setuptools >= 64: ``pip install -e`` builds an editable wheel from a folder it fills, not from build_lib
    from setuptools.command.editable_wheel import editable_wheel

    class EditableWheelWithPth(editable_wheel):
        def _install_namespaces(self, installation_dir, pth_prefix):
            super()._install_namespaces(installation_dir, pth_prefix)
            shutil.copy(PTH_SOURCE, os.path.join(installation_dir, PTH))

    commands["editable_wheel"] = EditableWheelWithPth
except ImportError:  # older setuptools: editable installs go through ``develop``, without the switch file
    pass


setup(cmdclass=commands)
