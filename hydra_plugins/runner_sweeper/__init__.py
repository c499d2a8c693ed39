"""The runner's Hydra sweeper (``hydra/sweeper=optuna``): Hydra loads sweepers only from this namespace."""
