"""``hydra/sweeper=optuna`` runs the runner's Optuna sweeper (optuna_sweeper.py beside this module).

Hydra scans the ``hydra_plugins`` package once per process and re-runs each plugin's module, whose
configs it stores again; so the scan is done first here, then the runner's config replaces the plugin's
``hydra/sweeper=optuna`` entry. The class is registered by hand because an editable install's
package is not on ``hydra_plugins``' path (an installed wheel's is, and registering twice is harmless).
"""


def install_optuna_sweeper() -> bool:
    """Make ``hydra/sweeper=optuna`` the runner's; False when hydra-optuna-sweeper is not installed."""
    try:
        from hydra_plugins.runner_sweeper.optuna_sweeper import RunnerOptunaConf, RunnerOptunaSweeper
    except ImportError:
        return False
    from hydra.core.config_store import ConfigStore
    from hydra.core.plugins import Plugins

    Plugins.instance().register(RunnerOptunaSweeper)  # the first call scans every plugin
    ConfigStore.instance().store(group="hydra/sweeper", name="optuna", node=RunnerOptunaConf, provider="runner")
    return True
