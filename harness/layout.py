"""Names of the work directory's stores, in a module that imports nothing heavy: a command checks them before it
loads torch's users, MLflow or Optuna."""

MLFLOW_STORE = "mlflow.db"  # the SQLite tracking store, where no tracking server is configured
OPTUNA_STORE = "optuna.db"  # the SQLite study storage, where no --storage is given
ARTIFACTS = "mlartifacts"  # the local tracking store's artifacts
STORES = (MLFLOW_STORE, OPTUNA_STORE)
