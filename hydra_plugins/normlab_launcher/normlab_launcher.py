"""Where Hydra finds normlab's launcher. The launcher is `normlab.launch.launcher.NormlabLauncher`; Hydra
instantiates only plugin classes whose module is under `hydra_plugins`, so this module names it there."""

from normlab.launch.launcher import NormlabLauncher as _NormlabLauncher


class NormlabLauncher(_NormlabLauncher):
    """`hydra/launcher=normlab`: normlab.launch.launcher.NormlabLauncher under the name Hydra accepts."""
