"""The one build step pyproject.toml cannot declare: ``adstore-enable.pth`` at the root of site-packages.

Everything else about the package is in pyproject.toml.  ``site`` runs the
file's line at every interpreter start, which is how ``ADSTORE_ENABLE=1``
(``adstore run``) reaches every Python process with no import in the
program (``integration/autoenable.py``).  A wheel gets the file through
``build_lib``; an editable install (PEP 660) does not copy ``build_lib``, so
there the file is written where setuptools unpacks the editable wheel
(``install_lib``), next to its own ``__editable__`` ``.pth``.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = Path(__file__).resolve().parent / "integration" / "adstore-enable.pth"


class BuildPyWithPth(build_py):
    """``build_py``, plus the start-up file at the top of the built tree (or of the editable wheel)."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            target = self.get_finalized_command("install").install_lib
        else:
            target = self.build_lib
        self.copy_file(str(PTH), str(Path(target, PTH.name)))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = list(super().get_outputs(include_bytecode))
        return outputs if self.editable_mode else [*outputs, str(Path(self.build_lib, PTH.name))]


setup(cmdclass={"build_py": BuildPyWithPth})
