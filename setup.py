"""setuptools' build (the project is described in pyproject.toml) with one addition: recipecache's start-up hook.

``recipecache-autoenable.pth`` goes to the root of the wheel, which is site-packages once installed, where Python
runs its one line in every process at start-up (:mod:`recipecache.autoenable`). An editable wheel
(``pip install -e``) is put together from the install directory rather than the build directory, so there it goes
to that directory instead.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

#: the hook's line, kept in the package (package data: the source distribution carries it)
STARTUP_HOOK = Path("recipecache", "recipecache-autoenable.pth")


class BuildPyWithStartupHook(build_py):
    def run(self) -> None:
        super().run()
        root = self.get_finalized_command("install").install_lib if self.editable_mode else self.build_lib
        self.copy_file(str(STARTUP_HOOK), str(Path(root, STARTUP_HOOK.name)), preserve_mode=False)


setup(cmdclass={"build_py": BuildPyWithStartupHook})
